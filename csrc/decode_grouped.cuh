// Paged decode, grouped: one thread block per (decode, KV head, partition) serves all
// G = Hq / Hkv query heads of that KV head, so each K/V byte is read from memory once per
// group. The per-head kernel (decode.cuh) reads it G times and is capped by L2 bandwidth on
// GQA models.
//
// QK: a warp takes one KV block, keeps its K vectors in registers (packed) and loops over the
// group's heads; query rows sit in shared memory as float. Softmax: one warp per head over the
// partition's scores. PV: a warp takes one KV block, keeps its V vectors in registers and
// accumulates up to kGroupChunk heads at once; out-of-context slots are zeroed by select.
#pragma once
#include "decode.cuh"

namespace pagedcore {

template <typename T, int HEAD, int BLOCK>
__global__ void __launch_bounds__(kDecodeThreads) decode_grouped_kernel(AttentionParams p) {
  constexpr int X = vec_elems<T>();
  constexpr int NWARPS = kDecodeThreads / 32;
  constexpr int TG = 32 / BLOCK;
  constexpr int CHUNKS = HEAD / X;
  constexpr int K_VECS = (CHUNKS + TG - 1) / TG;
  constexpr int V_VECS = BLOCK / X;
  constexpr int V_ROWS = 32 / V_VECS;
  constexpr int R = (HEAD + V_ROWS - 1) / V_ROWS;
  // Heads accumulated per PV sweep: keeps HG * R accumulators near 32 registers.
  constexpr int HG = R >= 32 ? 1 : (32 / R < kGroupChunkMax ? 32 / R : kGroupChunkMax);

  const int kv_head = blockIdx.x;
  const int item = blockIdx.y;
  const int part = blockIdx.z;
  const int req = p.work[item];
  const DecodeSpan span = decode_span(p, req);
  if (part >= span.num_parts) return;
  const int G = p.num_heads / p.num_kv_heads;
  const int head0 = kv_head * G;
  const int P = p.partition_size;
  const int p_begin = span.begin + part * P;
  const int p_end = min(p_begin + P, span.seq_len);
  const int blk_begin = p_begin / BLOCK;
  const int blk_end = cdiv(p_end, BLOCK);
  const int pos_q = span.seq_len - 1;

  extern __shared__ float smem[];
  float* q_s = smem;                               // [G][HEAD]
  float* logits = q_s + G * HEAD;                  // [G][P]
  float* out_s = logits + G * P;                   // [NWARPS][kGroupChunkMax][HEAD]
  float* m_s = out_s + NWARPS * kGroupChunkMax * HEAD;  // [G]
  float* l_s = m_s + G;                            // [G]

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int64_t q_tok = p.query_start_loc[req];
  const T* q = static_cast<const T*>(p.query) + q_tok * p.q_stride_t;
  for (int i = tid; i < G * HEAD; i += kDecodeThreads) {
    q_s[i] = to_float(q[static_cast<int64_t>(head0 + i / HEAD) * p.q_stride_h + i % HEAD]);
  }
  __syncthreads();

  const int* bt = p.block_table + static_cast<int64_t>(req) * p.block_table_stride;
  const T* k_cache = static_cast<const T*>(p.k_cache);
  const T* v_cache = static_cast<const T*>(p.v_cache);
  const int64_t head_stride = static_cast<int64_t>(HEAD) * BLOCK;

  const int tok = lane / TG;
  const int g = lane % TG;
  for (int blk = blk_begin + warp; blk < blk_end; blk += NWARPS) {
    const int64_t phys = bt[blk];
    const T* kb = k_cache + (phys * p.num_kv_heads + kv_head) * head_stride;
    uint4 kv[K_VECS];
#pragma unroll
    for (int j = 0; j < K_VECS; ++j) {
      const int c = g + j * TG;
      if (CHUNKS % TG == 0 || c < CHUNKS) {
        kv[j] = *reinterpret_cast<const uint4*>(kb + (c * BLOCK + tok) * X);
      }
    }
    const int pos = blk * BLOCK + tok;
    const bool visible = pos >= span.ctx_start && pos < p_end;
    for (int h = 0; h < G; ++h) {
      const float* qh = q_s + h * HEAD;
      float acc = 0.f;
#pragma unroll
      for (int j = 0; j < K_VECS; ++j) {
        const int c = g + j * TG;
        if (CHUNKS % TG == 0 || c < CHUNKS) {
          const T* e = reinterpret_cast<const T*>(&kv[j]);
#pragma unroll
          for (int i = 0; i < X; ++i) acc += qh[c * X + i] * to_float(e[i]);
        }
      }
#pragma unroll
      for (int m = TG / 2; m >= 1; m /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, m);
      if (g == 0) {
        const float slope = p.alibi_slopes != nullptr ? p.alibi_slopes[head0 + h] : 0.f;
        const float s = transform_score(acc, p.scale, p.soft_cap, slope, pos, pos_q);
        logits[h * P + pos - p_begin] = visible ? s : -INFINITY;
      }
    }
  }
  __syncthreads();

  const int n_tok = (blk_end - blk_begin) * BLOCK;
  for (int h = warp; h < G; h += NWARPS) {
    float* lh = logits + h * P;
    float m = -INFINITY;
    for (int i = lane; i < n_tok; i += 32) m = fmaxf(m, lh[i]);
    m = warp_max(m);
    float sum = 0.f;
    for (int i = lane; i < n_tok; i += 32) {
      const float s = lh[i];
      const float e = s == -INFINITY ? 0.f : __expf(s - m);
      lh[i] = e;
      sum += e;
    }
    sum = warp_sum(sum);
    if (lane == 0) {
      m_s[h] = m;
      l_s[h] = sum;
    }
  }
  __syncthreads();

  const int vv = lane % V_VECS;
  const int row0 = lane / V_VECS;
  for (int h0 = 0; h0 < G; h0 += HG) {
    float acc[HG][R];
#pragma unroll
    for (int j = 0; j < HG; ++j) {
#pragma unroll
      for (int r = 0; r < R; ++r) acc[j][r] = 0.f;
    }
    for (int blk = blk_begin + warp; blk < blk_end; blk += NWARPS) {
      const int64_t phys = bt[blk];
      const T* vb = v_cache + (phys * p.num_kv_heads + kv_head) * head_stride;
      const int tok0 = blk * BLOCK + vv * X;
      const bool edge = tok0 < span.ctx_start || tok0 + X > p_end;
      uint4 vr[R];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int d = row0 + r * V_ROWS;
        if (HEAD % V_ROWS == 0 || d < HEAD) {
          vr[r] = *reinterpret_cast<const uint4*>(vb + d * BLOCK + vv * X);
        }
      }
#pragma unroll
      for (int j = 0; j < HG; ++j) {
        if (h0 + j < G) {
          const float* ph = logits + (h0 + j) * P + tok0 - p_begin;
          float pr[X];
#pragma unroll
          for (int i = 0; i < X; ++i) pr[i] = ph[i];
#pragma unroll
          for (int r = 0; r < R; ++r) {
            const int d = row0 + r * V_ROWS;
            if (HEAD % V_ROWS == 0 || d < HEAD) {
              const T* e = reinterpret_cast<const T*>(&vr[r]);
#pragma unroll
              for (int i = 0; i < X; ++i) {
                float v = to_float(e[i]);
                if (edge) {
                  const int t = tok0 + i;
                  v = (t >= span.ctx_start && t < p_end) ? v : 0.f;
                }
                acc[j][r] += pr[i] * v;
              }
            }
          }
        }
      }
    }
#pragma unroll
    for (int j = 0; j < HG; ++j) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int m = V_VECS / 2; m >= 1; m /= 2) {
          acc[j][r] += __shfl_xor_sync(0xffffffffu, acc[j][r], m);
        }
      }
    }
    if (vv == 0) {
#pragma unroll
      for (int j = 0; j < HG; ++j) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const int d = row0 + r * V_ROWS;
          if (HEAD % V_ROWS == 0 || d < HEAD) {
            out_s[(warp * kGroupChunkMax + j) * HEAD + d] = acc[j][r];
          }
        }
      }
    }
    __syncthreads();
    for (int i = tid; i < HG * HEAD; i += kDecodeThreads) {
      const int j = i / HEAD, d = i % HEAD, h = h0 + j;
      if (h >= G) continue;
      float v = 0.f;
#pragma unroll
      for (int w = 0; w < NWARPS; ++w) v += out_s[(w * kGroupChunkMax + j) * HEAD + d];
      const float l = l_s[h];
      const float inv = l > 0.f ? 1.f / l : 0.f;
      if (span.num_parts == 1) {
        T* out = static_cast<T*>(p.out) + q_tok * p.o_stride_t +
                 static_cast<int64_t>(head0 + h) * p.o_stride_h;
        out[d] = from_float<T>(v * inv);
      } else {
        const int64_t row =
            (static_cast<int64_t>(item) * p.num_heads + head0 + h) * p.max_partitions + part;
        p.tmp_out[row * HEAD + d] = v * inv;
        if (d == 0) {
          p.max_logits[row] = m_s[h];
          p.exp_sums[row] = l;
        }
      }
    }
    __syncthreads();  // out_s is rewritten by the next sweep
  }
}

template <typename T, int HEAD, int BLOCK>
cudaError_t launch_decode_grouped_block(const AttentionParams& p, cudaStream_t stream) {
  const int group = p.num_heads / p.num_kv_heads;
  const int smem = decode_grouped_smem_bytes(HEAD, p.partition_size, group);
  auto kernel = decode_grouped_kernel<T, HEAD, BLOCK>;
  if (smem > 48 * 1024) {
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return err;
  }
  const dim3 grid(p.num_kv_heads, p.num_items, p.max_partitions);
  kernel<<<grid, kDecodeThreads, smem, stream>>>(p);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || p.max_partitions == 1) return err;
  return launch_decode_reduce<T, HEAD>(p, stream);
}

}  // namespace pagedcore
