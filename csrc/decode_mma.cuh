// Paged decode on tensor cores, FlashAttention-2 / flash-decoding style (fp16 and bf16).
//
// Grid (Hkv * ceil(G / 16), num_decodes, max_partitions), 4 warps. A thread block serves up to
// 16 query heads of one KV head (the whole GQA group when G <= 16) over one partition, so each
// K/V byte is read from memory once per group. The heads are the M rows of
// `mma.m16n8k16`; each warp walks its own 16-key tiles (warp w takes tiles w, w + 4, ...) and
// keeps scores, probabilities, the running max / sum and the output in registers: no shared
// memory and no barrier until the four warps merge their partial results once at the end.
//
// Loads go straight from the paged cache to registers, 16 bytes (K) and 8 bytes (V) at a
// time, all of a tile's (UNROLL tiles' with UNROLL = 2) issued before the first use, so each
// warp keeps 8-16 KB in flight. To allow such loads the key and head-dim orders inside a tile
// are permuted consistently (the dot products and sums do not care):
//   * S = Q K^T, k = head dims: for the k-step pair covering chunks 4p..4p+3 (8 dims each),
//     lane t = lane % 4 owns chunk 4p + t, elements 0-3 in the first step, 4-7 in the second;
//     Q fragments are built from the same chunks, so its B fragment is one 16-byte K vector.
//   * S columns <-> keys: column 2t + e of n-tile 0 is key 4t + e, of n-tile 1 key 4t + 2 + e,
//     so each lane's four scores per row are keys 4t..4t+3, exactly the rows of its V B
//     fragment (8 consecutive bytes of one V row, the `[D][block]` layout).
// Keys outside [ctx_start, partition end) get score -inf, and their V elements are zeroed by
// select before the product, so stale NaNs in unused slots never reach the output.
//
// C, the cache element type, is T or an fp8 type (e4m3 / e5m2). With fp8 each lane loads the
// same elements as with T, in half the bytes (8 bytes of K: its 8 head dims, from the fp8
// layout's 16-element vectors; 4 bytes of V), keeps them raw in registers while the loads
// fly, and widens them exactly to fp16 just before the mma (`cvt.rn.f16x2.e4m3x2` /
// `.e5m2x2`: every fp8 value is an fp16). The mmas then run in fp16 whatever T is (a bf16 Q
// is rounded to fp16 once: 3 more mantissa bits, the range of any sane query), k_scale
// multiplies the scores and v_scale the output, so the cache is never dequantized to memory.
#pragma once
#include <type_traits>

#include "decode.cuh"
#include "decode_merge.cuh"
#include "decode_fp8_keys.cuh"
#include "mma.cuh"

namespace pagedcore {

constexpr int kMmaDecodeWarps = kMmaDecodeThreads / 32;

// Two fp8 values (lower byte first) as one fp16x2 register, exactly.
template <typename C>
__device__ __forceinline__ uint32_t fp8x2_to_half2(uint32_t two) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(
      static_cast<__nv_fp8x2_storage_t>(two & 0xffffu),
      std::is_same_v<C, __nv_fp8_e4m3> ? __NV_E4M3 : __NV_E5M2);
  return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}

// A lane's raw K piece (8 head dims) and V piece (4 keys of one head dim) as mma fragments:
// the loaded registers themselves for a cache in T, widened from fp8 otherwise.
template <typename C>
__device__ __forceinline__ uint4 k_fragment(const uint4& raw) { return raw; }
template <typename C>
__device__ __forceinline__ uint4 k_fragment(const uint2& raw) {
  return make_uint4(fp8x2_to_half2<C>(raw.x), fp8x2_to_half2<C>(raw.x >> 16),
                    fp8x2_to_half2<C>(raw.y), fp8x2_to_half2<C>(raw.y >> 16));
}
template <typename C>
__device__ __forceinline__ uint2 v_fragment(const uint2& raw) { return raw; }
template <typename C>
__device__ __forceinline__ uint2 v_fragment(const uint32_t& raw) {
  return make_uint2(fp8x2_to_half2<C>(raw), fp8x2_to_half2<C>(raw >> 16));
}

template <typename T, int HEAD, int BLOCK, bool BIG, int UNROLL, int STAGES, typename C = T>
__global__ void __launch_bounds__(kMmaDecodeThreads) decode_mma_kernel(AttentionParams p) {
  constexpr int CHUNKS = HEAD / 8;          // 16-byte vectors per K row
  constexpr int PAIRS = (CHUNKS + 3) / 4;   // pairs of k-steps (32 head dims each)
  constexpr int NT = HEAD / 8;              // output n-tiles
  constexpr int NW = kMmaDecodeWarps;
  constexpr bool F8 = is_fp8<C>();
  using M = std::conditional_t<F8, __half, T>;          // the mma input type
  using KRaw = std::conditional_t<F8, uint2, uint4>;    // a lane's K piece as loaded
  using VRaw = std::conditional_t<F8, uint32_t, uint2>; // a lane's V piece as loaded
  static_assert(HEAD % 16 == 0 && BLOCK % 4 == 0, "head size % 16 and block size % 4");
  static_assert(!F8 || (STAGES == 0 && BLOCK % 16 == 0),
                "fp8: registers only (no cp.async ring), block size 16 or 32");

  const int G = p.num_heads / p.num_kv_heads;
  const int hchunks = (G + 15) / 16;
  const int kv_head = blockIdx.x / hchunks;
  const int head0 = kv_head * G + (blockIdx.x % hchunks) * 16;
  const int rows = min(16, kv_head * G + G - head0);
  const int item = blockIdx.y;
  const int part = blockIdx.z;
  const int req = p.work[item];
  const DecodeSpan span = decode_span(p, req);
  if (part >= span.num_parts) return;
  const int p_begin = span.partition_begin(part, p.partition_size);
  const int p_end = span.partition_end(part, p.partition_size);
  const int pos_q = span.seq_len - 1;
  const int n_tiles = cdiv(p_end - p_begin, 16);

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int64_t q_tok = p.query_start_loc[req];
  const uint4 zero4 = make_uint4(0, 0, 0, 0);

  // Q as A fragments: rows g and g + 8 (heads head0 + g, + 8), chunk 4 * pair + t.
  uint32_t qa[PAIRS][2][4];
  {
    const T* q = static_cast<const T*>(p.query) + q_tok * p.q_stride_t;
#pragma unroll
    for (int pr = 0; pr < PAIRS; ++pr) {
      const int c = 4 * pr + t;
      uint4 lo = zero4, hi = zero4;
      if (CHUNKS % 4 == 0 || c < CHUNKS) {
        if (g < rows) lo = *reinterpret_cast<const uint4*>(q + (head0 + g) * p.q_stride_h + c * 8);
        if (BIG && g + 8 < rows) {
          hi = *reinterpret_cast<const uint4*>(q + (head0 + g + 8) * p.q_stride_h + c * 8);
        }
      }
      lo = as_mma_type<T, M>(lo);
      hi = as_mma_type<T, M>(hi);
      qa[pr][0][0] = lo.x;
      qa[pr][0][1] = hi.x;
      qa[pr][0][2] = lo.y;
      qa[pr][0][3] = hi.y;
      qa[pr][1][0] = lo.z;
      qa[pr][1][1] = hi.z;
      qa[pr][1][2] = lo.w;
      qa[pr][1][3] = hi.w;
    }
  }
  const bool has_alibi = p.alibi_slopes != nullptr;
  const float slope[2] = {has_alibi && g < rows ? p.alibi_slopes[head0 + g] : 0.f,
                          has_alibi && g + 8 < rows ? p.alibi_slopes[head0 + g + 8] : 0.f};
  const bool plain = !has_alibi && p.soft_cap <= 0.f;
  float k_scale = 1.f, v_scale = 1.f;  // fp8: the cache's dequantization scales
  if constexpr (F8) {
    k_scale = *p.k_scale;
    v_scale = *p.v_scale;
  }
  const float scale_log2 = p.scale * kLog2e * k_scale;

  float o[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY};  // running max, log2 units
  float l[2] = {0.f, 0.f};              // this lane's part of the running sum

  const int* bt = p.block_table + static_cast<int64_t>(req) * p.block_table_stride;
  const C* k_cache = static_cast<const C*>(p.k_cache);
  const C* v_cache = static_cast<const C*>(p.v_cache);
  const int64_t head_off = static_cast<int64_t>(kv_head) * HEAD * BLOCK;
  const int64_t blk_stride = static_cast<int64_t>(p.num_kv_heads) * HEAD * BLOCK;

  // Physical blocks of a tile's keys for this lane: its two K keys and its V group. Looked up
  // one iteration ahead, so the block-table read is off the load chain of the tile.
  auto lookup = [&](int tile, int (&kph)[2], int& vph) {
    const int kb = p_begin + tile * 16;
    const bool tile_ok = tile < n_tiles;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const int key = kb + 4 * (g / 2) + 2 * nt + (g & 1);
      kph[nt] = tile_ok && key >= span.ctx_start && key < p_end ? bt[key / BLOCK] : 0;
    }
    const int key0 = kb + 4 * t;
    vph = tile_ok && key0 + 4 > span.ctx_start && key0 < p_end ? bt[key0 / BLOCK] : 0;
  };
  // One 16-key tile starting at key kb: S = Q K^T, online softmax, O += P V (registers only).
  auto compute = [&](int kb, const KRaw (&kraw)[2][PAIRS], const VRaw (&vraw)[NT]) {
    // S = Q K^T for this tile's 16 keys (two n-tiles of 8).
    float s[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const float z[4] = {0.f, 0.f, 0.f, 0.f};
      const uint4 k0 = k_fragment<C>(kraw[nt][0]);
      const uint32_t b0[2] = {k0.x, k0.y};
      mma_16816<M>(s[nt], qa[0][0], b0, z);
      const uint32_t b1[2] = {k0.z, k0.w};
      mma_acc<M>(s[nt], qa[0][1], b1);
#pragma unroll
      for (int pr = 1; pr < PAIRS; ++pr) {
        const uint4 kp = k_fragment<C>(kraw[nt][pr]);
        const uint32_t c0[2] = {kp.x, kp.y};
        mma_acc<M>(s[nt], qa[pr][0], c0);
        const uint32_t c1[2] = {kp.z, kp.w};
        mma_acc<M>(s[nt], qa[pr][1], c1);
      }
    }
    // Lane's keys kb + 4t + i, i = 0..3; row r = 0 (head g) and 1 (head g + 8).
    const int key0 = kb + 4 * t;
    bool vis[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) vis[i] = key0 + i >= span.ctx_start && key0 + i < p_end;
    float pr_[2][4];
#pragma unroll
    for (int r = 0; r < (BIG ? 2 : 1); ++r) {
      float x[4] = {s[0][2 * r], s[0][2 * r + 1], s[1][2 * r], s[1][2 * r + 1]};
      float mx = -INFINITY;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float v = plain ? x[i] * scale_log2
                              : kLog2e * transform_score(x[i] * k_scale, p.scale, p.soft_cap,
                                                         slope[r], key0 + i, pos_q);
        x[i] = vis[i] ? v : -INFINITY;
        mx = fmaxf(mx, x[i]);
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m[r], mx);
      const float alpha = m_new == -INFINITY ? 1.f : fast_exp2(m[r] - m_new);
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        pr_[r][i] = x[i] == -INFINITY ? 0.f : fast_exp2(x[i] - m_new);
        sum += pr_[r][i];
      }
      l[r] = l[r] * alpha + sum;
      m[r] = m_new;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        o[j][2 * r] *= alpha;
        o[j][2 * r + 1] *= alpha;
      }
    }
    uint32_t pa[4];
    pa[0] = pack2<M>(pr_[0][0], pr_[0][1]);
    pa[2] = pack2<M>(pr_[0][2], pr_[0][3]);
    if constexpr (BIG) {
      pa[1] = pack2<M>(pr_[1][0], pr_[1][1]);
      pa[3] = pack2<M>(pr_[1][2], pr_[1][3]);
    } else {
      pa[1] = pa[3] = 0u;
    }
    const bool edge = !(vis[0] && vis[3]);  // vis is contiguous: ends decide
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const uint2 vt = v_fragment<C>(vraw[j]);
      uint32_t b[2] = {vt.x, vt.y};
      if (edge) {
        b[0] = keep_halves(b[0], vis[0], vis[1]);
        b[1] = keep_halves(b[1], vis[2], vis[3]);
      }
      mma_acc<M>(o[j], pa, b);
      if constexpr (!BIG) o[j][2] = o[j][3] = 0.f;
    }
  };

  if constexpr (STAGES == 0) {
    int kph[UNROLL][2], vph[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) lookup(warp + u * NW, kph[u], vph[u]);

    for (int it = warp; it < n_tiles; it += NW * UNROLL) {
      KRaw kr[UNROLL][2][PAIRS];
      VRaw vr[UNROLL][NT];
      // Issue every load of the UNROLL tiles first.
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int kb = p_begin + (it + u * NW) * 16;
        const bool tile_ok = it + u * NW < n_tiles;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const int key = kb + 4 * (g / 2) + 2 * nt + (g & 1);
          const bool ok = tile_ok && key >= span.ctx_start && key < p_end;
          // The key's row: 16-byte vectors of 8 dims (T) or of 16 dims (fp8, read as halves).
          constexpr int X = F8 ? 16 : 8;
          const C* kp = k_cache + static_cast<int64_t>(kph[u][nt]) * blk_stride + head_off +
                        (key % BLOCK) * X;
#pragma unroll
          for (int pr = 0; pr < PAIRS; ++pr) {
            const int c = 4 * pr + t;
            const bool cok = ok && (CHUNKS % 4 == 0 || c < CHUNKS);
            if constexpr (F8) {
              kr[u][nt][pr] = cok ? *reinterpret_cast<const uint2*>(
                                        kp + (c / 2) * BLOCK * 16 + (c % 2) * 8)
                                  : make_uint2(0, 0);
            } else {
              kr[u][nt][pr] = cok ? *reinterpret_cast<const uint4*>(kp + c * BLOCK * 8) : zero4;
            }
          }
        }
        const int key0 = kb + 4 * t;
        const bool gok = tile_ok && key0 + 4 > span.ctx_start && key0 < p_end;
        const C* vp = v_cache + static_cast<int64_t>(vph[u]) * blk_stride + head_off +
                      (key0 % BLOCK) + g * BLOCK;
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          vr[u][j] = gok ? *reinterpret_cast<const VRaw*>(vp + j * 8 * BLOCK) : VRaw{};
        }
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) lookup(it + NW * UNROLL + u * NW, kph[u], vph[u]);
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        if (it + u * NW >= n_tiles) break;
        compute(p_begin + (it + u * NW) * 16, kr[u], vr[u]);
      }
    }
  } else {
    // STAGES-deep ring of this warp's tiles in shared memory, filled by cp.async: each lane
    // copies exactly the 16-byte K and 8-byte V pieces it will read itself, so its own
    // cp.async.wait_group is the only synchronisation; tile k + STAGES - 1 streams in while
    // tile k is computed.
    extern __shared__ __align__(16) unsigned char ring_raw[];
    constexpr int K_BYTES = 2 * PAIRS * 32 * 16;
    constexpr int STAGE_BYTES = K_BYTES + NT * 32 * 8;
    unsigned char* ring = ring_raw + warp * STAGES * STAGE_BYTES;
    int rk[2], rv;
    auto issue = [&](int tile, int stage) {
      unsigned char* st = ring + stage * STAGE_BYTES;
      const int kb = p_begin + tile * 16;
      const bool tile_ok = tile < n_tiles;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int key = kb + 4 * (g / 2) + 2 * nt + (g & 1);
        const bool ok = tile_ok && key >= span.ctx_start && key < p_end;
        const C* kp = k_cache + static_cast<int64_t>(rk[nt]) * blk_stride + head_off +
                      (ok ? key % BLOCK : 0) * 8;
#pragma unroll
        for (int pr = 0; pr < PAIRS; ++pr) {
          const int c = 4 * pr + t;
          const bool cok = ok && (CHUNKS % 4 == 0 || c < CHUNKS);
          cp_async_16(st + ((nt * PAIRS + pr) * 32 + lane) * 16, kp + (cok ? c : 0) * BLOCK * 8,
                      cok);
        }
      }
      const int key0 = kb + 4 * t;
      const bool gok = tile_ok && key0 + 4 > span.ctx_start && key0 < p_end;
      const C* vp = v_cache + static_cast<int64_t>(rv) * blk_stride + head_off +
                    (gok ? key0 % BLOCK : 0) + g * BLOCK;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        cp_async_8(st + K_BYTES + (j * 32 + lane) * 8, vp + j * 8 * BLOCK, gok);
      }
    };
    lookup(warp, rk, rv);
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      issue(warp + s * NW, s);
      cp_async_commit();
      lookup(warp + (s + 1) * NW, rk, rv);
    }
    for (int k = 0;; ++k) {
      const int tile = warp + k * NW;
      if (tile >= n_tiles) break;
      cp_async_wait<STAGES - 2>();  // this lane's pieces of tile k have landed
      const unsigned char* st = ring + (k % STAGES) * STAGE_BYTES;
      uint4 kt[2][PAIRS];
      uint2 vt[NT];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int pr = 0; pr < PAIRS; ++pr) {
          kt[nt][pr] = *reinterpret_cast<const uint4*>(st + ((nt * PAIRS + pr) * 32 + lane) * 16);
        }
      }
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        vt[j] = *reinterpret_cast<const uint2*>(st + K_BYTES + (j * 32 + lane) * 8);
      }
      issue(tile + (STAGES - 1) * NW, (k + STAGES - 1) % STAGES);  // the stage read at k - 1
      cp_async_commit();
      lookup(tile + STAGES * NW, rk, rv);
      compute(p_begin + tile * 16, kt, vt);
    }
    cp_async_wait<0>();
    __syncthreads();  // the merge below reuses the ring's shared memory
  }

  // Merge the four warps: m, l and the output rows through shared memory, once.
  extern __shared__ float smem[];
  float* o_s = smem;                     // [NW][16][HEAD]
  float* m_s = o_s + NW * 16 * HEAD;     // [NW][16]
  float* l_s = m_s + NW * 16;            // [NW][16]
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    const int row = g + 8 * r;
    if (!BIG && r == 1) {
      if (t == 0) {
        m_s[warp * 16 + row] = -INFINITY;
        l_s[warp * 16 + row] = 0.f;
      }
      continue;
    }
    if (t == 0) {
      m_s[warp * 16 + row] = m[r];
      l_s[warp * 16 + row] = l[r];
    }
    float* orow = o_s + (warp * 16 + row) * HEAD + 2 * t;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      *reinterpret_cast<float2*>(orow + 8 * j) = make_float2(o[j][2 * r], o[j][2 * r + 1]);
    }
  }
  __syncthreads();
  write_merged_rows<T, HEAD, 16, NW>(p, m_s, l_s, o_s, rows, head0, v_scale, span, item, part,
                                    q_tok);
}

// Dynamic shared memory: the warps' merge buffers, or the STAGES-deep rings when larger.
template <int HEAD, int STAGES>
constexpr int decode_mma_kernel_smem() {
  constexpr int stage = 32 * (2 * ((HEAD / 8 + 3) / 4) * 16 + (HEAD / 8) * 8);
  constexpr int ring = kMmaDecodeWarps * STAGES * stage;
  constexpr int merge = 4 * kMmaDecodeWarps * 16 * (HEAD + 2);
  return ring > merge ? ring : merge;
}

template <typename T, int HEAD, int BLOCK, bool BIG, int UNROLL, int STAGES, typename C = T>
cudaError_t launch_decode_mma_cfg(const AttentionParams& p, cudaStream_t stream) {
  constexpr int smem = decode_mma_kernel_smem<HEAD, STAGES>();
  static_assert(STAGES > 0 || smem == 4 * kMmaDecodeWarps * 16 * (HEAD + 2),
                "params.h decode_mma_smem_bytes mirrors the register path");
  auto kernel = decode_mma_kernel<T, HEAD, BLOCK, BIG, UNROLL, STAGES, C>;
  if (smem > 48 * 1024) {
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return err;
  }
  const int group = p.num_heads / p.num_kv_heads;
  const dim3 grid(p.num_kv_heads * ((group + 15) / 16), p.num_items, p.max_partitions);
  kernel<<<grid, kMmaDecodeThreads, smem, stream>>>(p);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || p.max_partitions == 1) return err;
  return launch_decode_reduce<T, HEAD>(p, stream);
}

// p.decode_unroll: 1 / 2 = tiles whose loads a warp issues together into registers;
// 3 = a 3-stage cp.async ring in shared memory per warp.
template <typename T, int HEAD, int BLOCK>
cudaError_t launch_decode_mma_block(const AttentionParams& p, cudaStream_t stream) {
  const bool big = p.num_heads / p.num_kv_heads > 8;
  if (p.decode_unroll == 3) {
    return big ? launch_decode_mma_cfg<T, HEAD, BLOCK, true, 1, 3>(p, stream)
               : launch_decode_mma_cfg<T, HEAD, BLOCK, false, 1, 3>(p, stream);
  }
  if (p.decode_unroll == 2) {
    return big ? launch_decode_mma_cfg<T, HEAD, BLOCK, true, 2, 0>(p, stream)
               : launch_decode_mma_cfg<T, HEAD, BLOCK, false, 2, 0>(p, stream);
  }
  return big ? launch_decode_mma_cfg<T, HEAD, BLOCK, true, 1, 0>(p, stream)
             : launch_decode_mma_cfg<T, HEAD, BLOCK, false, 1, 0>(p, stream);
}

template <typename T, int HEAD>
cudaError_t launch_decode_mma_head(const AttentionParams& p, cudaStream_t stream) {
  switch (p.block_size) {
    case 8:
      return launch_decode_mma_block<T, HEAD, 8>(p, stream);
    case 16:
      return launch_decode_mma_block<T, HEAD, 16>(p, stream);
    case 32:
      return launch_decode_mma_block<T, HEAD, 32>(p, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

template <typename T>
cudaError_t launch_decode_mma(const AttentionParams& p, int head_size, cudaStream_t stream) {
  if (p.num_items == 0) return cudaSuccess;
  switch (head_size) {
    case 64:
      return launch_decode_mma_head<T, 64>(p, stream);
    case 80:
      return launch_decode_mma_head<T, 80>(p, stream);
    case 96:
      return launch_decode_mma_head<T, 96>(p, stream);
    case 112:
      return launch_decode_mma_head<T, 112>(p, stream);
    case 128:
      return launch_decode_mma_head<T, 128>(p, stream);
    default:
      return cudaErrorInvalidValue;  // 256: the classic kernels (register budget)
  }
}

// fp8 cache (e4m3 / e5m2, block sizes 16 and 32). Head sizes 64 / 128 with at most 8 query
// heads per KV head run the keys-as-rows kernel (decode_fp8_keys.cuh; faster on the H100 at
// 64x4096 / 8x32768 / 256x1024, docs/benchmarks/cuda_paged.md) unless
// PAGEDCORE_CUDA_PAGED_FP8_DECODE=rows; the rest this grouped kernel: registers only, two
// 16-key tiles of loads in flight per warp (the bytes of one bf16 tile). Measured slower on
// the H200 at 64x4096 / 8x32768 / 256x1024: three tiles (236 registers), four (spills at head
// size 128), two with registers capped for three blocks per SM (docs/benchmarks/cuda_paged.md).
template <typename T, int HEAD, typename C>
cudaError_t launch_decode_mma_fp8_head(const AttentionParams& p, cudaStream_t stream) {
  cudaError_t keys_err = cudaSuccess;
  if (launch_decode_fp8_keys<T, HEAD, C>(p, stream, keys_err)) return keys_err;
  const bool big = p.num_heads / p.num_kv_heads > 8;
  if (p.block_size == 16) {
    return big ? launch_decode_mma_cfg<T, HEAD, 16, true, 2, 0, C>(p, stream)
               : launch_decode_mma_cfg<T, HEAD, 16, false, 2, 0, C>(p, stream);
  }
  if (p.block_size == 32) {
    return big ? launch_decode_mma_cfg<T, HEAD, 32, true, 2, 0, C>(p, stream)
               : launch_decode_mma_cfg<T, HEAD, 32, false, 2, 0, C>(p, stream);
  }
  return cudaErrorInvalidValue;
}

template <typename T, typename C>
cudaError_t launch_decode_mma_fp8(const AttentionParams& p, int head_size, cudaStream_t stream) {
  if (p.num_items == 0) return cudaSuccess;
  switch (head_size) {
    case 64:
      return launch_decode_mma_fp8_head<T, 64, C>(p, stream);
    case 80:
      return launch_decode_mma_fp8_head<T, 80, C>(p, stream);
    case 96:
      return launch_decode_mma_fp8_head<T, 96, C>(p, stream);
    case 112:
      return launch_decode_mma_fp8_head<T, 112, C>(p, stream);
    case 128:
      return launch_decode_mma_fp8_head<T, 128, C>(p, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace pagedcore
