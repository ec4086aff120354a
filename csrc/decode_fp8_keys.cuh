// Paged decode over an fp8 cache on tensor cores with the keys as the mma's M rows.
//
// The grouped kernel of decode_mma.cuh puts a KV head's query heads in the 16 M rows of
// `mma.m16n8k16`; at GQA 4 (Llama-3, 32 / 8 heads) 12 of them are padding, and every score,
// exponential and output register of a padding row is paid for. Here S^T = K Q^T and
// O^T = V^T P^T: the 16 keys of a tile are the M rows, the (at most 8) query heads the N
// columns, so per 16-key tile a warp runs VEC (head dims / 16) + HEAD / 16 mmas instead of
// twice that, holds half the output registers and computes 4 exponentials per lane, not 8.
// Each warp streams its tiles through a STAGES-deep ring in shared memory filled by
// cp.async, so STAGES - 1 tiles (4 KB each at head size 128) are in flight per warp without
// holding registers: with the grouped kernel's scheme (loads straight into registers, two
// tiles issued together after the previous two were computed) and with a register ring of 2
// or 3 tiles, the warps waited on memory at 2-3 blocks per SM (H100, session 25).
//
// Grid (Hkv, num_decodes, max_partitions), 4 warps; warp w takes tiles w, w + 4, ...
// Fragment orders (g = lane / 4, t = lane % 4; mma.cuh lists the m16n8k16 layouts):
//   * S^T k-step s (16 head dims): lane t's four dims are 16 (t VPL + s / 4) + 4 (s % 4) + 0..3
//     (VPL = head dims / 64 vectors per lane), so per key row a lane reads VPL whole 16-byte
//     vectors of the fp8 layout; Q^T's B fragments are built from the same dims.
//   * S^T row r of a tile is key rho(r): rho(g) = 4 (g / 2) + (g & 1), rho(g + 8) = rho(g) + 2.
//     After `movmatrix.trans` the B fragment of P^T holds, for lane t, the probabilities of
//     keys 4t..4t+3: exactly the 4 bytes the lane reads of a V row (the [D][block] layout).
//   * O^T row = head dim (16 per m-tile), column = query head; a lane owns heads 2t, 2t + 1
//     in both S^T and O^T, so the softmax state (max, sum) of a head lives in the 8 lanes
//     sharing t.
// The running max is rescaled lazily: a tile rescales (one warp-wide vote, shuffles, the
// output multiply) only when some score exceeds the current max by more than 2^8, so the
// probabilities stay <= 256 (fp16-safe) and most tiles skip the rescale. Keys outside
// [ctx_start, partition end) get score -inf and their V bytes are zeroed before widening, so
// stale NaNs in unused slots never reach the output. fp8 widens exactly to fp16
// (`cvt.rn.f16x2.e4m3x2` / `.e5m2x2`); k_scale joins the score scale, v_scale the output.
#pragma once
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "decode.cuh"
#include "decode_merge.cuh"
#include "mma.cuh"

namespace pagedcore {

// log2 of the largest probability a lazily rescaled tile may produce (2^8 = 256).
constexpr float kLazyRescaleLog2 = 8.f;

// One 32-bit word of four fp8 values (lowest byte first) as two fp16x2 registers: `lo` holds
// bytes 0-1, `hi` bytes 2-3.
template <typename C>
__device__ __forceinline__ void fp8x4_to_half2x2(uint32_t w, uint32_t& lo, uint32_t& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if constexpr (std::is_same_v<C, __nv_fp8_e4m3>) {
    asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n"
        " cvt.rn.f16x2.e4m3x2 %0, l;\n cvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
        : "=r"(lo), "=r"(hi) : "r"(w));
  } else {
    asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n"
        " cvt.rn.f16x2.e5m2x2 %0, l;\n cvt.rn.f16x2.e5m2x2 %1, h;\n}\n"
        : "=r"(lo), "=r"(hi) : "r"(w));
  }
#else  // no fp8 conversion instruction before sm_89: cuda_fp8.h's emulation
  constexpr __nv_fp8_interpretation_t kind =
      std::is_same_v<C, __nv_fp8_e4m3> ? __NV_E4M3 : __NV_E5M2;
  const __half2_raw a = __nv_cvt_fp8x2_to_halfraw2(
      static_cast<__nv_fp8x2_storage_t>(w & 0xffffu), kind);
  const __half2_raw b = __nv_cvt_fp8x2_to_halfraw2(
      static_cast<__nv_fp8x2_storage_t>(w >> 16), kind);
  lo = static_cast<uint32_t>(a.x) | (static_cast<uint32_t>(a.y) << 16);
  hi = static_cast<uint32_t>(b.x) | (static_cast<uint32_t>(b.y) << 16);
#endif
}

// The 8x8 matrix of 16-bit elements held by a warp as one register a lane (lane holds row
// lane / 4, columns 2 (lane % 4) and +1), transposed.
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// Keeps the bytes of `w` whose key is visible (bit i of `vis` for byte i).
__device__ __forceinline__ uint32_t keep_bytes(uint32_t w, unsigned vis) {
  const uint32_t mask = (vis & 1u ? 0x000000ffu : 0u) | (vis & 2u ? 0x0000ff00u : 0u) |
                        (vis & 4u ? 0x00ff0000u : 0u) | (vis & 8u ? 0xff000000u : 0u);
  return w & mask;
}

__device__ __forceinline__ uint32_t word_of(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

template <typename T, int HEAD, int BLOCK, int STAGES, typename C>
__global__ void __launch_bounds__(kMmaDecodeThreads, STAGES < 5 ? 4 : 1)
    decode_fp8_keys_kernel(AttentionParams p) {
  constexpr int VEC = HEAD / 16;  // 16-byte fp8 vectors per K row = k-steps of S^T
  constexpr int VPL = VEC / 4;    // vectors a lane reads per key row
  constexpr int MT = HEAD / 16;   // m-tiles (16 head dims) of O^T
  constexpr int NW = kMmaDecodeThreads / 32;
  static_assert(HEAD % 64 == 0 && (BLOCK == 16 || BLOCK == 32) && STAGES >= 2,
                "head size 64 / 128, block size 16 / 32");
  static_assert(is_fp8<C>(), "the keys-as-rows decode reads an fp8 cache");

  const int G = p.num_heads / p.num_kv_heads;  // <= 8 (the launcher checks)
  const int kv_head = blockIdx.x;
  const int head0 = kv_head * G;
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

  // Q^T as B fragments: lane (g, t) holds head head0 + g (zero past the group), k-step s's
  // dims 16 (t VPL + s / 4) + 4 (s % 4) + {0, 1} in b[0] and + {2, 3} in b[1], as fp16.
  uint32_t qb[VEC][2];
  {
    const T* q = static_cast<const T*>(p.query) + q_tok * p.q_stride_t +
                 static_cast<int64_t>(head0 + (g < G ? g : 0)) * p.q_stride_h + t * VPL * 16;
#pragma unroll
    for (int v = 0; v < VPL; ++v) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        uint4 raw = make_uint4(0, 0, 0, 0);
        if (g < G) raw = *reinterpret_cast<const uint4*>(q + v * 16 + half * 8);
        const uint4 h = as_mma_type<T, __half>(raw);
        const int s = v * 4 + 2 * half;
        qb[s][0] = h.x;
        qb[s][1] = h.y;
        qb[s + 1][0] = h.z;
        qb[s + 1][1] = h.w;
      }
    }
  }
  const bool has_alibi = p.alibi_slopes != nullptr;
  float slope[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    slope[h] = has_alibi && 2 * t + h < G ? p.alibi_slopes[head0 + 2 * t + h] : 0.f;
  }
  const bool plain = !has_alibi && p.soft_cap <= 0.f;
  const float k_scale = *p.k_scale, v_scale = *p.v_scale;
  const float scale_log2 = p.scale * kLog2e * k_scale;

  float o[MT][4];
#pragma unroll
  for (int j = 0; j < MT; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY};  // running max of heads 2t, 2t + 1 (log2 units)
  float l[2] = {0.f, 0.f};              // this lane's part of their running sums

  const int* bt = p.block_table + static_cast<int64_t>(req) * p.block_table_stride;
  const C* k_cache = static_cast<const C*>(p.k_cache);
  const C* v_cache = static_cast<const C*>(p.v_cache);
  const int64_t head_off = static_cast<int64_t>(kv_head) * HEAD * BLOCK;
  const int64_t blk_stride = static_cast<int64_t>(p.num_kv_heads) * HEAD * BLOCK;
  const int row0 = 4 * (g / 2) + (g & 1);  // rho(g); rho(g + 8) = row0 + 2

  // A tile's physical block, or -1 when none of its keys is visible (nothing is read).
  auto lookup = [&](int tile) -> int {
    const int kb = p_begin + tile * 16;
    return tile < n_tiles && kb + 16 > span.ctx_start ? bt[kb / BLOCK] : -1;
  };
  // One 16-key tile: S^T = K Q^T, online softmax, O^T += V^T P^T (registers only).
  auto compute = [&](int tile, const uint4 (&kr)[VPL][2], const uint32_t (&vr)[MT][2]) {
    const int kb = p_begin + tile * 16;
    float sa[4] = {0.f, 0.f, 0.f, 0.f}, sb[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int s = 0; s < VEC; ++s) {
      uint32_t a[4];
      fp8x4_to_half2x2<C>(word_of(kr[s / 4][0], s % 4), a[0], a[2]);
      fp8x4_to_half2x2<C>(word_of(kr[s / 4][1], s % 4), a[1], a[3]);
      mma_acc<__half>(s % 2 ? sb : sa, a, qb[s]);  // two chains: half the dependent latency
    }
    // x[h][r]: head 2t + h, key kb + rho(g) + 2r.
    float x[2][2] = {{sa[0] + sb[0], sa[2] + sb[2]}, {sa[1] + sb[1], sa[3] + sb[3]}};
    const bool full = kb >= span.ctx_start && kb + 16 <= p_end;  // warp-uniform
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int key = kb + row0 + 2 * r;
      const bool vis = full || (key >= span.ctx_start && key < p_end);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float v = plain ? x[h][r] * scale_log2
                              : kLog2e * transform_score(x[h][r] * k_scale, p.scale,
                                                         p.soft_cap, slope[h], key, pos_q);
        x[h][r] = vis ? v : -INFINITY;
      }
    }
    const float lmx[2] = {fmaxf(x[0][0], x[0][1]), fmaxf(x[1][0], x[1][1])};
    if (__any_sync(0xffffffffu, lmx[0] > m[0] + kLazyRescaleLog2 ||
                                    lmx[1] > m[1] + kLazyRescaleLog2)) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = lmx[h];
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
        const float m_new = fmaxf(m[h], mx);
        const float alpha = m_new == -INFINITY ? 1.f : fast_exp2(m[h] - m_new);
        l[h] *= alpha;
#pragma unroll
        for (int j = 0; j < MT; ++j) {
          o[j][h] *= alpha;
          o[j][2 + h] *= alpha;
        }
        m[h] = m_new;
      }
    }
    float pr[2][2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        pr[h][r] = x[h][r] == -INFINITY ? 0.f : fast_exp2(x[h][r] - m[h]);
      }
      l[h] += pr[h][0] + pr[h][1];
    }
    // P^T (keys x heads) as the B fragment: S^T rows 0-7 and 8-15, each transposed.
    const uint32_t b[2] = {movmatrix_trans(pack2<__half>(pr[0][0], pr[1][0])),
                           movmatrix_trans(pack2<__half>(pr[0][1], pr[1][1]))};
    unsigned vvis = 0xfu;  // keys kb + 4t + i, i = 0..3
    if (!full) {
      vvis = 0u;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int key = kb + 4 * t + i;
        vvis |= (key >= span.ctx_start && key < p_end ? 1u : 0u) << i;
      }
    }
#pragma unroll
    for (int j = 0; j < MT; ++j) {
      uint32_t w0 = vr[j][0], w1 = vr[j][1];
      if (!full) {
        w0 = keep_bytes(w0, vvis);
        w1 = keep_bytes(w1, vvis);
      }
      uint32_t a[4];
      fp8x4_to_half2x2<C>(w0, a[0], a[2]);
      fp8x4_to_half2x2<C>(w1, a[1], a[3]);
      mma_acc<__half>(o[j], a, b);
    }
  };

  {
    // STAGES-deep ring of this warp's tiles in shared memory, filled by cp.async (no registers
    // held by loads in flight). A stage is the tile's K (VEC x 16 keys x 16 bytes, key rows
    // XOR-swizzled by 2 (vector / VPL) so that a quarter-warp's 16-byte reads hit 8 distinct
    // bank groups) then its V (HEAD rows x 16 keys). The lanes copy 16-byte chunks
    // cooperatively; each waits for its own copies, then __syncwarp makes the warp's visible.
    extern __shared__ uint4 ring_all[];
    constexpr int K_CHUNKS = VEC * 16, STAGE_CHUNKS = K_CHUNKS + HEAD;
    uint4* ring = ring_all + warp * STAGES * STAGE_CHUNKS;
    auto issue = [&](int tile, int phys, int stage) {
      if (phys < 0) return;
      uint4* st = ring + stage * STAGE_CHUNKS;
      const int in_blk = (p_begin + tile * 16) % BLOCK;
      const C* kp = k_cache + static_cast<int64_t>(phys) * blk_stride + head_off + in_blk * 16;
      const C* vp = v_cache + static_cast<int64_t>(phys) * blk_stride + head_off + in_blk;
#pragma unroll
      for (int i = 0; i < K_CHUNKS / 32; ++i) {
        const int c = lane + 32 * i, vv = c / 16, k = c % 16;
        cp_async_16(st + vv * 16 + (k ^ (2 * (vv / VPL))), kp + vv * BLOCK * 16 + k * 16, true);
      }
#pragma unroll
      for (int i = 0; i < HEAD / 32; ++i) {
        const int r = lane + 32 * i;
        cp_async_16(st + K_CHUNKS + r, vp + r * BLOCK, true);
      }
    };
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      issue(warp + s * NW, lookup(warp + s * NW), s);
      cp_async_commit();
    }
    int ph = lookup(warp + (STAGES - 1) * NW);  // the block of the next tile to issue
    int stage = 0;
    for (int tile = warp; tile < n_tiles; tile += NW) {
      cp_async_wait<STAGES - 2>();  // this lane's copies of the tile have landed
      __syncwarp();                 // and every lane's
      const uint4* st = ring + stage * STAGE_CHUNKS;
      uint4 kr[VPL][2];
      uint32_t vr[MT][2];
#pragma unroll
      for (int v = 0; v < VPL; ++v) {
        const int vv = t * VPL + v;
#pragma unroll
        for (int r = 0; r < 2; ++r) kr[v][r] = st[vv * 16 + ((row0 + 2 * r) ^ (2 * t))];
      }
      const uint32_t* vs = reinterpret_cast<const uint32_t*>(st + K_CHUNKS);
#pragma unroll
      for (int j = 0; j < MT; ++j) {
        vr[j][0] = vs[(16 * j + g) * 4 + t];
        vr[j][1] = vs[(16 * j + g + 8) * 4 + t];
      }
      // Refill the stage read in the previous iteration (every lane is past it: __syncwarp).
      const int prev = stage == 0 ? STAGES - 1 : stage - 1;
      issue(tile + (STAGES - 1) * NW, ph, prev);
      cp_async_commit();
      ph = lookup(tile + STAGES * NW);
      stage = stage == STAGES - 1 ? 0 : stage + 1;
      // A tile without a visible key copied nothing (its stage holds stale bytes): skip it.
      if (p_begin + tile * 16 + 16 > span.ctx_start) compute(tile, kr, vr);
    }
    cp_async_wait<0>();
    __syncthreads();  // the merge below reuses the rings' shared memory
  }

  // Merge the four warps: m, l and O^T through shared memory, once.
  extern __shared__ float smem[];
  float* o_s = smem;                 // [NW][8][HEAD]
  float* m_s = o_s + NW * 8 * HEAD;  // [NW][8]
  float* l_s = m_s + NW * 8;         // [NW][8]
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 4);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 8);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 16);
    const int col = warp * 8 + 2 * t + h;
    if (g == 0) {
      m_s[col] = m[h];
      l_s[col] = l[h];
    }
    float* orow = o_s + col * HEAD + g;
#pragma unroll
    for (int j = 0; j < MT; ++j) {
      orow[16 * j] = o[j][h];
      orow[16 * j + 8] = o[j][2 + h];
    }
  }
  __syncthreads();
  write_merged_rows<T, HEAD, 8, NW>(p, m_s, l_s, o_s, G, head0, v_scale, span, item, part,
                                    q_tok);
}

// Dynamic shared memory: the warps' merge buffers, or the STAGES-deep rings when larger.
template <int HEAD, int STAGES>
constexpr int decode_fp8_keys_smem() {
  constexpr int merge = static_cast<int>(sizeof(float)) * (kMmaDecodeThreads / 32) * 8 * (HEAD + 2);
  constexpr int ring = 16 * (kMmaDecodeThreads / 32) * STAGES * (HEAD / 16 * 16 + HEAD);
  return ring > merge ? ring : merge;
}

template <typename T, int HEAD, int BLOCK, int STAGES, typename C>
cudaError_t launch_decode_fp8_keys_cfg(const AttentionParams& p, cudaStream_t stream) {
  constexpr int smem = decode_fp8_keys_smem<HEAD, STAGES>();
  auto kernel = decode_fp8_keys_kernel<T, HEAD, BLOCK, STAGES, C>;
  if (smem > 48 * 1024) {
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return err;
  }
  const dim3 grid(p.num_kv_heads, p.num_items, p.max_partitions);
  kernel<<<grid, kMmaDecodeThreads, smem, stream>>>(p);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || p.max_partitions == 1) return err;
  return launch_decode_reduce<T, HEAD>(p, stream);
}

// Which fp8 decode runs where both can (head size 64 / 128, at most 8 query heads per KV head):
// this kernel with a 3-stage ring (the default; 4 blocks of 4 warps per SM at head size 128),
// or as set by PAGEDCORE_CUDA_PAGED_FP8_DECODE (tuning): "rows" (the grouped kernel of
// decode_mma.cuh, heads as M rows), "ring4" / "ring6" (4 / 6 stages). Read once per process.
enum class Fp8Decode { kRows, kRing3, kRing4, kRing6 };
inline Fp8Decode fp8_decode_choice() {
  static const Fp8Decode choice = [] {
    const char* env = std::getenv("PAGEDCORE_CUDA_PAGED_FP8_DECODE");
    if (env == nullptr) return Fp8Decode::kRing3;
    const char* names[] = {"rows", "ring3", "ring4", "ring6"};
    for (int i = 0; i < 4; ++i) {
      if (std::strcmp(env, names[i]) == 0) return static_cast<Fp8Decode>(i);
    }
    return Fp8Decode::kRing3;
  }();
  return choice;
}

template <typename T, int HEAD, int BLOCK, typename C>
cudaError_t launch_decode_fp8_keys_block(const AttentionParams& p, Fp8Decode choice,
                                         cudaStream_t stream) {
  switch (choice) {
    case Fp8Decode::kRing4:
      return launch_decode_fp8_keys_cfg<T, HEAD, BLOCK, 4, C>(p, stream);
    case Fp8Decode::kRing6:
      return launch_decode_fp8_keys_cfg<T, HEAD, BLOCK, 6, C>(p, stream);
    default:
      return launch_decode_fp8_keys_cfg<T, HEAD, BLOCK, 3, C>(p, stream);
  }
}

// Launches the keys-as-rows fp8 decode when it applies; false when the caller's kernel runs.
template <typename T, int HEAD, typename C>
bool launch_decode_fp8_keys(const AttentionParams& p, cudaStream_t stream, cudaError_t& err) {
  if constexpr (HEAD % 64 != 0) {
    return false;
  } else {
    const Fp8Decode choice = fp8_decode_choice();
    if (choice == Fp8Decode::kRows || p.num_heads / p.num_kv_heads > 8) return false;
    err = p.block_size == 16 ? launch_decode_fp8_keys_block<T, HEAD, 16, C>(p, choice, stream)
                             : launch_decode_fp8_keys_block<T, HEAD, 32, C>(p, choice, stream);
    return true;
  }
}

}  // namespace pagedcore
