// Paged prefill / chunked prefill: any number of query tokens per request, keys read from the
// paged cache (history and this step's tokens alike), causal with the query aligned to the end
// of its sequence.
//
// Grid (num_tiles, Hq), 4 warps. A tile is 64 query rows of one request (the planner lists
// (request, first row) pairs in `work`); warp w owns rows 16w..16w+15. Key tiles of 32 are
// staged in shared memory: K as [key][dim] (the column-major B operand of S = Q K^T) and V
// transposed as [dim][key] (the column-major B operand of O += P V). fp16/bf16 use tensor
// cores through WMMA 16x16x16 with fp32 accumulation; fp32 has no WMMA shape of its own (tf32
// would lose precision the conformance tolerances do not allow), so it runs the same tiling on
// CUDA cores. Online softmax keeps per-row max and sum in shared memory; the fp32 output tile
// lives in shared memory so each warp can rescale its rows without knowing the fragment layout.
// Keys outside [lowest window start of the tile, seq_len) are loaded as zeros, so NaNs in
// unused or freed slots never reach a product.
#pragma once
#include <mma.h>

#include <type_traits>

#include "dtype.cuh"
#include "params.h"

namespace pagedcore {

constexpr int kPrefillWarps = 4;
constexpr int kPrefillThreads = 32 * kPrefillWarps;
constexpr int kPrefillRows = 16 * kPrefillWarps;  // BM
constexpr int kPrefillKeys = 32;                  // BN

__host__ __device__ constexpr int round_up(int a, int b) { return (a + b - 1) / b * b; }

template <typename T, int HEAD>
struct PrefillSmem {
  static constexpr int X = vec_elems<T>();
  static constexpr int PAD = X;                      // keeps rows 16-byte aligned, skews banks
  static constexpr int LDQ = HEAD + PAD;             // Q and K rows (elements of T)
  static constexpr int LDV = kPrefillKeys + PAD;     // V^T rows
  static constexpr int LDS = kPrefillKeys + 4;       // scores (float)
  static constexpr int LDP = kPrefillKeys + PAD;     // probabilities (T)
  static constexpr int LDO = HEAD + 4;               // output accumulator (float)
  static constexpr int Q_OFF = 0;
  static constexpr int K_OFF = round_up(Q_OFF + kPrefillRows * LDQ * int(sizeof(T)), 128);
  static constexpr int V_OFF = round_up(K_OFF + kPrefillKeys * LDQ * int(sizeof(T)), 128);
  static constexpr int S_OFF = round_up(V_OFF + HEAD * LDV * int(sizeof(T)), 128);
  static constexpr int P_OFF = round_up(S_OFF + kPrefillRows * LDS * 4, 128);
  static constexpr int O_OFF = round_up(P_OFF + kPrefillRows * LDP * int(sizeof(T)), 128);
  static constexpr int M_OFF = round_up(O_OFF + kPrefillRows * LDO * 4, 128);
  static constexpr int L_OFF = M_OFF + kPrefillRows * 4;
  static constexpr int BYTES = L_OFF + kPrefillRows * 4;
};

template <typename T>
struct WmmaType {
  using type = T;
};

// S[16 rows of this warp][32 keys] = Q K^T.
template <typename T, int HEAD>
__device__ __forceinline__ void warp_scores(const T* q_s, const T* k_s, float* s_s, int warp,
                                            int lane) {
  using L = PrefillSmem<T, HEAD>;
  if constexpr (std::is_same_v<T, float>) {
    for (int r = 0; r < 16; ++r) {
      const float* qr = q_s + (16 * warp + r) * L::LDQ;
      const float* kr = k_s + lane * L::LDQ;
      float acc = 0.f;
#pragma unroll 8
      for (int d = 0; d < HEAD; ++d) acc += qr[d] * kr[d];
      s_s[(16 * warp + r) * L::LDS + lane] = acc;
    }
  } else {
    using namespace nvcuda;
    for (int n = 0; n < kPrefillKeys / 16; ++n) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::fill_fragment(acc, 0.f);
#pragma unroll
      for (int k = 0; k < HEAD / 16; ++k) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> b;
        wmma::load_matrix_sync(a, q_s + 16 * warp * L::LDQ + 16 * k, L::LDQ);
        wmma::load_matrix_sync(b, k_s + 16 * n * L::LDQ + 16 * k, L::LDQ);
        wmma::mma_sync(acc, a, b, acc);
      }
      wmma::store_matrix_sync(s_s + 16 * warp * L::LDS + 16 * n, acc, L::LDS,
                              wmma::mem_row_major);
    }
  }
}

// O[16 rows of this warp][HEAD] += P V.
template <typename T, int HEAD>
__device__ __forceinline__ void warp_accumulate(const T* p_s, const T* vt_s, float* o_s, int warp,
                                                int lane) {
  using L = PrefillSmem<T, HEAD>;
  if constexpr (std::is_same_v<T, float>) {
    for (int r = 0; r < 16; ++r) {
      const float* pr = p_s + (16 * warp + r) * L::LDP;
      float* orow = o_s + (16 * warp + r) * L::LDO;
      for (int d = lane; d < HEAD; d += 32) {
        const float* vr = vt_s + d * L::LDV;
        float acc = 0.f;
#pragma unroll
        for (int k = 0; k < kPrefillKeys; ++k) acc += pr[k] * vr[k];
        orow[d] += acc;
      }
    }
  } else {
    using namespace nvcuda;
#pragma unroll
    for (int n = 0; n < HEAD / 16; ++n) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      float* o_tile = o_s + 16 * warp * L::LDO + 16 * n;
      wmma::load_matrix_sync(acc, o_tile, L::LDO, wmma::mem_row_major);
#pragma unroll
      for (int k = 0; k < kPrefillKeys / 16; ++k) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> b;
        wmma::load_matrix_sync(a, p_s + 16 * warp * L::LDP + 16 * k, L::LDP);
        wmma::load_matrix_sync(b, vt_s + 16 * n * L::LDV + 16 * k, L::LDV);
        wmma::mma_sync(acc, a, b, acc);
      }
      wmma::store_matrix_sync(o_tile, acc, L::LDO, wmma::mem_row_major);
    }
  }
}

// Widens 16 bytes of cache elements C to T and stores them at `dst` (16-byte aligned); with
// `lo`/`hi` given, elements j with pos0 + j outside [lo, hi) are stored as zeros (by select).
template <typename T, typename C>
__device__ __forceinline__ void store_widened(T* dst, const uint4& raw, int pos0, int lo,
                                              int hi) {
  constexpr int N = vec_elems<C>();
  alignas(16) T tmp[N];
  const C* e = reinterpret_cast<const C*>(&raw);
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const bool keep = pos0 + j >= lo && pos0 + j < hi;
    tmp[j] = from_float<T>(keep ? to_float(e[j]) : 0.f);
  }
#pragma unroll
  for (int j = 0; j < N * int(sizeof(T)) / 16; ++j) {
    reinterpret_cast<uint4*>(dst)[j] = reinterpret_cast<const uint4*>(tmp)[j];
  }
}

// C is the cache element type: T, or an fp8 type (K/V tiles widened exactly into T in shared
// memory; k_scale folds into the score scale, v_scale into the output normalisation).
template <typename T, int HEAD, typename C = T>
__global__ void __launch_bounds__(kPrefillThreads) prefill_kernel(AttentionParams p) {
  using L = PrefillSmem<T, HEAD>;
  constexpr int X = L::X;
  constexpr int BM = kPrefillRows;
  constexpr int BN = kPrefillKeys;
  static_assert(HEAD % 16 == 0, "WMMA tiles need head sizes that are multiples of 16");

  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* q_s = reinterpret_cast<T*>(smem_raw + L::Q_OFF);
  T* k_s = reinterpret_cast<T*>(smem_raw + L::K_OFF);
  T* vt_s = reinterpret_cast<T*>(smem_raw + L::V_OFF);
  float* s_s = reinterpret_cast<float*>(smem_raw + L::S_OFF);
  T* p_s = reinterpret_cast<T*>(smem_raw + L::P_OFF);
  float* o_s = reinterpret_cast<float*>(smem_raw + L::O_OFF);
  float* m_s = reinterpret_cast<float*>(smem_raw + L::M_OFF);
  float* l_s = reinterpret_cast<float*>(smem_raw + L::L_OFF);

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int head = blockIdx.y;
  const int req = p.work[2 * blockIdx.x];
  const int row0 = p.work[2 * blockIdx.x + 1];
  const int q_begin = p.query_start_loc[req];
  const int q_len = p.query_start_loc[req + 1] - q_begin;
  const int seq_len = p.seq_lens[req];
  const int ctx = seq_len - q_len;  // position of query row 0
  const int rows = min(BM, q_len - row0);
  if (rows <= 0) return;  // a padding tile (fp8 path: 64-row tiles split from 128-row ones)
  const int kv_head = head / (p.num_heads / p.num_kv_heads);
  const float slope = p.alibi_slopes != nullptr ? p.alibi_slopes[head] : 0.f;

  // Keys any row of the tile may see: [kv_lo, kv_hi).
  const int first_pos = ctx + row0;
  const int last_pos = ctx + row0 + rows - 1;
  const int kv_lo = p.window > 0 ? max(0, first_pos - p.window + 1) : 0;
  const int kv_hi = p.causal ? min(seq_len, last_pos + 1) : seq_len;

  const T* query = static_cast<const T*>(p.query);
  const uint4 zero = make_uint4(0, 0, 0, 0);
  for (int i = tid; i < BM * (HEAD / X); i += kPrefillThreads) {
    const int r = i / (HEAD / X), c = i % (HEAD / X);
    uint4 v = zero;
    if (r < rows) {
      const int64_t tok = q_begin + row0 + r;
      v = *reinterpret_cast<const uint4*>(query + tok * p.q_stride_t + head * p.q_stride_h +
                                          c * X);
    }
    *reinterpret_cast<uint4*>(q_s + r * L::LDQ + c * X) = v;
  }
  for (int i = tid; i < BM * L::LDO; i += kPrefillThreads) o_s[i] = 0.f;
  for (int i = tid; i < BM; i += kPrefillThreads) {
    m_s[i] = -INFINITY;
    l_s[i] = 0.f;
  }

  const int* bt = p.block_table + static_cast<int64_t>(req) * p.block_table_stride;
  const T* k_cache = static_cast<const T*>(p.k_cache);
  const T* v_cache = static_cast<const T*>(p.v_cache);
  const int B = p.block_size;
  const int64_t head_stride = static_cast<int64_t>(HEAD) * B;
  float qk_scale = p.scale, v_scale = 1.f;
  if constexpr (is_fp8<C>()) {
    qk_scale *= *p.k_scale;
    v_scale = *p.v_scale;
  }

  for (int kt = (kv_lo / BN) * BN; kt < kv_hi; kt += BN) {
    __syncthreads();  // previous tile's K/V no longer read; Q/O init visible on first pass
    if constexpr (is_fp8<C>()) {
      constexpr int XC = vec_elems<C>();  // 16 fp8 elements per 16-byte vector
      const C* kc_cache = static_cast<const C*>(p.k_cache);
      const C* vc_cache = static_cast<const C*>(p.v_cache);
      for (int i = tid; i < BN * (HEAD / XC); i += kPrefillThreads) {
        const int kk = i % BN, c = i / BN;
        const int pos = kt + kk;
        uint4 v = zero;
        const bool in = pos >= kv_lo && pos < kv_hi;
        if (in) {
          const int64_t phys = bt[pos / B];
          v = *reinterpret_cast<const uint4*>(
              kc_cache + (phys * p.num_kv_heads + kv_head) * head_stride +
              (static_cast<int64_t>(c) * B + pos % B) * XC);
        }
        store_widened<T, C>(k_s + kk * L::LDQ + c * XC, v, 0, 0, in ? XC : 0);
      }
      for (int i = tid; i < HEAD * (BN / XC); i += kPrefillThreads) {
        const int kc = i % (BN / XC), d = i / (BN / XC);
        const int pos0 = kt + kc * XC;
        uint4 v = zero;
        if (pos0 + XC > kv_lo && pos0 < kv_hi) {
          const int64_t phys = bt[max(pos0, kv_lo) / B];
          v = *reinterpret_cast<const uint4*>(
              vc_cache + (phys * p.num_kv_heads + kv_head) * head_stride +
              static_cast<int64_t>(d) * B + pos0 % B);
        }
        store_widened<T, C>(vt_s + d * L::LDV + kc * XC, v, pos0, kv_lo, kv_hi);
      }
    } else {
    // K: threads walk keys fastest so a warp reads consecutive 16-byte vectors of one block.
    for (int i = tid; i < BN * (HEAD / X); i += kPrefillThreads) {
      const int kk = i % BN, c = i / BN;
      const int pos = kt + kk;
      uint4 v = zero;
      if (pos >= kv_lo && pos < kv_hi) {
        const int64_t phys = bt[pos / B];
        v = *reinterpret_cast<const uint4*>(
            k_cache + (phys * p.num_kv_heads + kv_head) * head_stride +
            (static_cast<int64_t>(c) * B + pos % B) * X);
      }
      *reinterpret_cast<uint4*>(k_s + kk * L::LDQ + c * X) = v;
    }
    // V^T: a 16-byte vector holds X consecutive keys of one dim (X divides the block size).
    for (int i = tid; i < HEAD * (BN / X); i += kPrefillThreads) {
      const int kc = i % (BN / X), d = i / (BN / X);
      const int pos0 = kt + kc * X;
      uint4 v = zero;
      if (pos0 + X > kv_lo && pos0 < kv_hi) {
        const int64_t phys = bt[max(pos0, kv_lo) / B];
        v = *reinterpret_cast<const uint4*>(
            v_cache + (phys * p.num_kv_heads + kv_head) * head_stride +
            static_cast<int64_t>(d) * B + pos0 % B);
        if (pos0 < kv_lo || pos0 + X > kv_hi) {
          T* e = reinterpret_cast<T*>(&v);
#pragma unroll
          for (int j = 0; j < X; ++j) {
            if (pos0 + j < kv_lo || pos0 + j >= kv_hi) e[j] = from_float<T>(0.f);
          }
        }
      }
      *reinterpret_cast<uint4*>(vt_s + d * L::LDV + kc * X) = v;
    }
    }  // cache dtype
    __syncthreads();

    warp_scores<T, HEAD>(q_s, k_s, s_s, warp, lane);
    __syncwarp();

    if (p.prefill_lane_per_key) {
      // Lane j owns key kt + j; rows one after another (the first, slower formulation, kept
      // as a reference path).
      const int pos_k = kt + lane;
      for (int r = 0; r < 16; ++r) {
        const int row = 16 * warp + r;
        const int pos_q = first_pos + row;
        bool visible = row < rows && pos_k >= kv_lo && pos_k < kv_hi;
        if (p.causal) visible = visible && pos_k <= pos_q;
        if (p.window > 0) visible = visible && pos_q - pos_k < p.window;
        const float s = transform_score(s_s[row * L::LDS + lane], qk_scale, p.soft_cap, slope,
                                        pos_k, pos_q);
        const float row_max = warp_max(visible ? s : -INFINITY);
        const float m_old = m_s[row];
        const float m_new = fmaxf(m_old, row_max);
        const float e = visible ? __expf(s - m_new) : 0.f;
        const float alpha = m_old == -INFINITY ? 0.f : __expf(m_old - m_new);
        const float e_sum = warp_sum(e);
        p_s[row * L::LDP + lane] = from_float<T>(e);
        float* orow = o_s + row * L::LDO;
        for (int d = lane; d < HEAD; d += 32) orow[d] *= alpha;
        __syncwarp();
        if (lane == 0) {
          m_s[row] = m_new;
          l_s[row] = l_s[row] * alpha + e_sum;
        }
      }
      __syncwarp();
    } else
    // Online softmax: lanes 2r and 2r+1 own row r of this warp's 16 rows, half the keys each,
    // so all 16 rows advance together (a lane-per-key loop would chain 16 dependent rows of
    // warp-wide shuffles per key tile).
    {
      constexpr int PER = BN / 2;
      const int r = lane / 2, half = lane % 2;
      const int row = 16 * warp + r;
      const int pos_q = first_pos + row;
      const bool row_ok = row < rows;
      float sv[PER];
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < PER; ++j) {
        const int col = half * PER + j;
        const int pos_k = kt + col;
        bool visible = row_ok && pos_k >= kv_lo && pos_k < kv_hi;
        if (p.causal) visible = visible && pos_k <= pos_q;
        if (p.window > 0) visible = visible && pos_q - pos_k < p.window;
        const float s = transform_score(s_s[row * L::LDS + col], qk_scale, p.soft_cap, slope,
                                        pos_k, pos_q);
        sv[j] = visible ? s : -INFINITY;
        mx = fmaxf(mx, sv[j]);
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      const float m_old = m_s[row];
      const float m_new = fmaxf(m_old, mx);
      const float alpha = m_old == -INFINITY ? 0.f : __expf(m_old - m_new);
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < PER; ++j) {
        const float e = sv[j] == -INFINITY ? 0.f : __expf(sv[j] - m_new);
        sum += e;
        p_s[row * L::LDP + half * PER + j] = from_float<T>(e);
      }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      float* orow = o_s + row * L::LDO;
      for (int d = half; d < HEAD; d += 2) orow[d] *= alpha;
      __syncwarp();  // both lanes of a row have read m_s / l_s before lane 2r updates them
      if (half == 0) {
        m_s[row] = m_new;
        l_s[row] = l_s[row] * alpha + sum;
      }
    }
    __syncwarp();
    warp_accumulate<T, HEAD>(p_s, vt_s, o_s, warp, lane);
  }
  __syncwarp();

  T* out = static_cast<T*>(p.out);
  for (int r = 0; r < 16; ++r) {
    const int row = 16 * warp + r;
    if (row >= rows) break;
    const float l = l_s[row];
    const float inv = l > 0.f ? v_scale / l : 0.f;
    T* orow = out + static_cast<int64_t>(q_begin + row0 + row) * p.o_stride_t +
              static_cast<int64_t>(head) * p.o_stride_h;
    for (int d = lane; d < HEAD; d += 32) orow[d] = from_float<T>(o_s[row * L::LDO + d] * inv);
  }
}

template <typename T, int HEAD, typename C = T>
cudaError_t launch_prefill_head(const AttentionParams& p, cudaStream_t stream) {
  constexpr int smem = PrefillSmem<T, HEAD>::BYTES;
  auto kernel = prefill_kernel<T, HEAD, C>;
  if (smem > 48 * 1024) {
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return err;
  }
  kernel<<<dim3(p.num_items, p.num_heads), kPrefillThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

template <typename T, typename C = T>
cudaError_t launch_prefill(const AttentionParams& p, int head_size, cudaStream_t stream) {
  if (p.num_items == 0) return cudaSuccess;
  if (is_fp8<C>() && p.block_size % vec_elems<C>() != 0) return cudaErrorInvalidValue;
  switch (head_size) {
    case 64:
      return launch_prefill_head<T, 64, C>(p, stream);
    case 80:
      return launch_prefill_head<T, 80, C>(p, stream);
    case 96:
      return launch_prefill_head<T, 96, C>(p, stream);
    case 112:
      return launch_prefill_head<T, 112, C>(p, stream);
    case 128:
      return launch_prefill_head<T, 128, C>(p, stream);
    case 256:
      return launch_prefill_head<T, 256, C>(p, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

// fp8 cache: the WMMA (fp16/bf16) / CUDA-core (fp32) kernel, block sizes 16 and 32.
template <typename T>
cudaError_t launch_prefill_fp8(const AttentionParams& p, int head_size, Fp8 kind,
                               cudaStream_t stream) {
  return kind == Fp8::kE4M3 ? launch_prefill<T, __nv_fp8_e4m3>(p, head_size, stream)
                            : launch_prefill<T, __nv_fp8_e5m2>(p, head_size, stream);
}

}  // namespace pagedcore
