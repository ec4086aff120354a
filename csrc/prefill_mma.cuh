// Paged prefill / chunked prefill on tensor cores, FlashAttention-2 style (fp16 and bf16,
// head sizes 64-128; fp32 and head size 256 keep the WMMA / CUDA-core kernel of prefill.cuh).
//
// Grid (num_tiles, Hq), NW warps. A tile is 16 * MT * NW query rows of one request (`work`
// lists (request, first row)), warp w owning MT blocks of 16 rows as the M dimension of
// `mma.m16n8k16` (MT = 2: each K/V fragment read from shared memory feeds two mmas). Key
// tiles of KN (64 or 32) are gathered from the paged cache through the block table into
// shared memory with cp.async, ST tiles in flight (ST = 2: double buffered, two barriers per
// tile; ST = 3: a ring, the next two tiles stream in while one is computed, one barrier per
// tile): K as [key][dim] (16-byte vectors of the K layout land as they are), V transposed as
// [dim][key] (the V layout's rows), so `ldmatrix` (no transpose) gives the B fragments of
// both S = Q K^T and O += P V. Q fragments are loaded once into registers (MT = 1) or reread
// from shared memory per k-step (MT = 2, for the register budget); S, P, the running max /
// sum (fp32, log2 units) and O stay in registers, FA2's layout: the C fragment of S is the A
// fragment of P. Key tiles past the causal diagonal of the tile's last row are never
// visited; masks are applied only on tiles that need them (FAST: those tiles, and tiles with
// ALiBi / soft-cap, take the general softmax; the rest a straight-line one, and O is
// rescaled only when a row maximum of the warp moved).
// Keys outside [kv_lo, kv_hi) are zero-filled by cp.async (whole 16-byte vectors) or zeroed in
// shared memory (vectors straddling an edge), so NaNs in unused slots never reach a product.
#pragma once
#include "dtype.cuh"
#include "mma.cuh"
#include "params.h"

namespace pagedcore {

// NW warps of MT m-tiles (16 rows each) per thread block, KN keys per shared-memory tile,
// ST stages of K/V tiles in flight.
template <typename T, int HEAD, int MT, int NW, int KN, int ST>
struct FaSmem {
  static constexpr int ROWS = 16 * MT * NW;  // query rows per tile
  static constexpr int LDK = HEAD + 8;       // Q / K row stride (elements): 16-byte aligned rows,
  static constexpr int LDV = KN + 8;         // V^T row stride;  both skew ldmatrix banks
  static constexpr int Q_BYTES = ROWS * LDK * 2;
  static constexpr int K_BYTES = KN * LDK * 2;
  static constexpr int V_BYTES = HEAD * LDV * 2;
  static constexpr int K_OFF = Q_BYTES;
  static constexpr int V_OFF = K_OFF + ST * K_BYTES;
  static constexpr int BYTES = V_OFF + ST * V_BYTES;
};

// MINB: thread blocks per SM the register budget must allow (`__launch_bounds__`); HMAJOR:
// the query heads of one tile are consecutive thread blocks (the heads sharing a KV head run
// side by side and read the same K/V tiles), heaviest tiles first over all heads. WMASK (with
// FAST): masks decided per warp instead of per thread block, so on a tile that needs masks for
// the block (the causal diagonal, window edges) a warp whose rows see every key of the tile
// takes the straight-line softmax, and a warp whose rows see none of them (or that holds only
// padding rows) skips the tile's mmas and softmax (its running max / sum / O are unchanged,
// exactly as the masked softmax would leave them). ONEBAR (two stages): the ring's schedule,
// one barrier per tile: tile i + 1 is requested after the barrier that follows tile i's
// arrival (so only one tile is in flight, for the whole of tile i's compute). PMASK (with
// FAST): masked tiles without ALiBi / soft-cap take a straight-line softmax too, each row's
// visible keys being one range (a select per score instead of the general per-score code).
template <typename T, int HEAD, int MT, bool PIPE, int NW, int KN, int ST, bool FAST,
          int MINB = 1, bool HMAJOR = false, bool WMASK = false, bool ONEBAR = false,
          bool PMASK = false>
__global__ void __launch_bounds__(NW * 32, MINB) prefill_mma_kernel(AttentionParams p) {
  static_assert(ST == 2 || (PIPE && ST > 2), "more than two stages need the pipelined gather");
  static_assert(FAST || (!WMASK && !PMASK), "per-warp / plain masks need the fast softmax");
  // The cp.async ring (one barrier per tile): more than two stages, or two with ONEBAR.
  constexpr bool kRing = ST > 2 || ONEBAR;
  static_assert(!kRing || PIPE, "the ring needs the pipelined gather");
  using L = FaSmem<T, HEAD, MT, NW, KN, ST>;
  constexpr int kFaRows = L::ROWS;
  constexpr int kFaThreads = NW * 32;
  constexpr int kFaKeys = KN;
  constexpr int NS = KN / 8;     // n-tiles of S per m-tile
  constexpr int CH = HEAD / 8;   // 16-byte vectors per row
  constexpr int KS = HEAD / 16;  // k-steps of S = Q K^T
  constexpr int NT = HEAD / 8;   // n-tiles of O
  static_assert(HEAD % 16 == 0 && NT % 2 == 0, "head size must be a multiple of 16");

  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* q_s = reinterpret_cast<T*>(smem_raw);

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  // Heaviest tiles (last rows of a request under causal masking) are listed last: run first.
  const int linear = HMAJOR ? blockIdx.y * gridDim.x + blockIdx.x : 0;
  const int tile = gridDim.x - 1 - (HMAJOR ? linear / gridDim.y : blockIdx.x);
  const int head = HMAJOR ? linear % gridDim.y : blockIdx.y;
  const int req = p.work[2 * tile];
  const int row0 = p.work[2 * tile + 1];
  const int q_begin = p.query_start_loc[req];
  const int q_len = p.query_start_loc[req + 1] - q_begin;
  const int seq_len = p.seq_lens[req];
  const int ctx = seq_len - q_len;  // position of query row 0
  const int rows = min(kFaRows, q_len - row0);
  const int kv_head = head / (p.num_heads / p.num_kv_heads);
  const float slope = p.alibi_slopes != nullptr ? p.alibi_slopes[head] : 0.f;
  const bool plain = p.alibi_slopes == nullptr && p.soft_cap <= 0.f;
  const float scale_log2 = p.scale * kLog2e;

  const int first_pos = ctx + row0;
  const int last_pos = ctx + row0 + rows - 1;
  const int kv_lo = p.window > 0 ? max(0, first_pos - p.window + 1) : 0;
  const int kv_hi = p.causal ? min(seq_len, last_pos + 1) : seq_len;

  // Q tile -> shared memory (rows past the request are zeros).
  {
    const T* query = static_cast<const T*>(p.query);
    for (int i = tid; i < kFaRows * CH; i += kFaThreads) {
      const int r = i / CH, c = i % CH;
      const bool ok = r < rows;
      const T* src = query + static_cast<int64_t>(q_begin + (ok ? row0 + r : 0)) * p.q_stride_t +
                     static_cast<int64_t>(head) * p.q_stride_h + c * 8;
      cp_async_16(q_s + r * L::LDK + c * 8, src, ok);
    }
    cp_async_commit();
  }

  const int* bt = p.block_table + static_cast<int64_t>(req) * p.block_table_stride;
  const T* k_cache = static_cast<const T*>(p.k_cache);
  const T* v_cache = static_cast<const T*>(p.v_cache);
  const int B = p.block_size;
  const int64_t blk_stride = static_cast<int64_t>(p.num_kv_heads) * HEAD * B;
  const int64_t head_off = static_cast<int64_t>(kv_head) * HEAD * B;

  // PIPE: the gather with compile-time trip counts. Thread tid always handles key
  // tid % 64 of a K tile (chunks tid / 64 + 2r) and 8-key group tid % 8 of a V tile (dims
  // tid / 8 + 16r), so it needs two block-table entries per tile; they are read one tile ahead
  // (`lookup`), and the tile's cp.asyncs are issued back to back with shift / mask for the
  // power-of-two block size. (!PIPE: the first formulation, one lookup and one integer
  // division per 16-byte vector, each cp.async waiting on its lookup.)
  const int bshift = 31 - __clz(B);
  // Trip counts: K_TRIPS chunks of one key, V_TRIPS dims of one 8-key group per thread and
  // tile; the last trip is guarded where the thread count does not divide the head size.
  constexpr int K_STEP = kFaThreads / kFaKeys, K_TRIPS = (CH + K_STEP - 1) / K_STEP;
  constexpr int V_STEP = kFaThreads / (kFaKeys / 8), V_TRIPS = (HEAD + V_STEP - 1) / V_STEP;
  static_assert(kFaThreads % kFaKeys == 0 && kFaKeys % 16 == 0, "gather layout");
  const int k_kk = tid % kFaKeys, k_c0 = tid / kFaKeys;
  const int v_kc = tid % (kFaKeys / 8), v_d0 = tid / (kFaKeys / 8);
  auto lookup = [&](int kt, int& kph, int& vph) {
    const int pos = kt + k_kk;
    kph = pos >= kv_lo && pos < kv_hi ? bt[pos >> bshift] : -1;
    const int pos0 = kt + v_kc * 8;
    vph = pos0 + 8 > kv_lo && pos0 < kv_hi ? bt[pos0 >> bshift] : -1;
  };
  auto load_kv_pipe = [&](int kt, int stage, int kph, int vph) {
    T* k_s = reinterpret_cast<T*>(smem_raw + L::K_OFF + stage * L::K_BYTES);
    T* v_s = reinterpret_cast<T*>(smem_raw + L::V_OFF + stage * L::V_BYTES);
    const bool kok = kph >= 0, vok = vph >= 0;
    const T* ksrc = k_cache + static_cast<int64_t>(kok ? kph : 0) * blk_stride + head_off +
                    (kok ? (kt + k_kk) & (B - 1) : 0) * 8;
#pragma unroll
    for (int r = 0; r < K_TRIPS; ++r) {
      const int c = k_c0 + r * K_STEP;
      if (CH % K_STEP == 0 || c < CH) {
        cp_async_16(k_s + k_kk * L::LDK + c * 8, ksrc + static_cast<int64_t>(c) * B * 8, kok);
      }
    }
    const T* vsrc = v_cache + static_cast<int64_t>(vok ? vph : 0) * blk_stride + head_off +
                    (vok ? (kt + v_kc * 8) & (B - 1) : 0);
#pragma unroll
    for (int r = 0; r < V_TRIPS; ++r) {
      const int d = v_d0 + r * V_STEP;
      if (HEAD % V_STEP == 0 || d < HEAD) {
        cp_async_16(v_s + d * L::LDV + v_kc * 8, vsrc + static_cast<int64_t>(d) * B, vok);
      }
    }
  };

  auto load_kv = [&](int kt, int stage) {
    T* k_s = reinterpret_cast<T*>(smem_raw + L::K_OFF + stage * L::K_BYTES);
    T* v_s = reinterpret_cast<T*>(smem_raw + L::V_OFF + stage * L::V_BYTES);
    // K: keys fastest, so a warp reads consecutive 16-byte vectors of one block.
    for (int i = tid; i < kFaKeys * CH; i += kFaThreads) {
      const int kk = i % kFaKeys, c = i / kFaKeys;
      const int pos = kt + kk;
      const bool ok = pos >= kv_lo && pos < kv_hi;
      const int64_t phys = ok ? bt[pos / B] : 0;
      const T* src = k_cache + phys * blk_stride + head_off +
                     (static_cast<int64_t>(c) * B + (ok ? pos % B : 0)) * 8;
      cp_async_16(k_s + kk * L::LDK + c * 8, src, ok);
    }
    // V^T: one 16-byte vector = 8 consecutive keys of one dim (8 divides the block size).
    for (int i = tid; i < HEAD * (kFaKeys / 8); i += kFaThreads) {
      const int kc = i % (kFaKeys / 8), d = i / (kFaKeys / 8);
      const int pos0 = kt + kc * 8;
      const bool ok = pos0 + 8 > kv_lo && pos0 < kv_hi;
      const int64_t phys = ok ? bt[pos0 / B] : 0;
      const T* src = v_cache + phys * blk_stride + head_off + static_cast<int64_t>(d) * B +
                     (ok ? pos0 % B : 0);
      cp_async_16(v_s + d * L::LDV + kc * 8, src, ok);
    }
  };

  const int kt_begin = (kv_lo / kFaKeys) * kFaKeys;
  const int n_kt = kv_hi > kt_begin ? cdiv(kv_hi - kt_begin, kFaKeys) : 0;
  int kph = -1, vph = -1;  // PIPE: block-table entries of the next tile to load
  if constexpr (kRing) {
    // Tiles 0 .. ST - 2 in flight (one commit group each, empty past the end), then the
    // block-table entries of tile ST - 1.
#pragma unroll
    for (int st = 0; st < ST - 1; ++st) {
      if (st < n_kt) {
        lookup(kt_begin + st * kFaKeys, kph, vph);
        load_kv_pipe(kt_begin + st * kFaKeys, st, kph, vph);
      }
      cp_async_commit();
    }
    if (ST - 1 < n_kt) lookup(kt_begin + (ST - 1) * kFaKeys, kph, vph);
    cp_async_wait<ST - 1>();  // Q has landed
  } else if (n_kt > 0) {
    if constexpr (PIPE) {
      lookup(kt_begin, kph, vph);
      load_kv_pipe(kt_begin, 0, kph, vph);
      if (n_kt > 1) lookup(kt_begin + kFaKeys, kph, vph);
    } else {
      load_kv(kt_begin, 0);
    }
  }
  if constexpr (!kRing) {
    cp_async_commit();
    cp_async_wait<1>();  // Q has landed (the first K/V tile may still be in flight)
  }
  __syncthreads();

  // Q A fragments of m-tile mt, k-step ks (rows warp * 16 * MT + 16 * mt ..).
  auto load_q = [&](uint32_t (&f)[4], int mt, int ks) {
    const int r = (warp * MT + mt) * 16 + (lane / 8 % 2) * 8 + lane % 8;
    ldmatrix_x4(f, q_s + r * L::LDK + ks * 16 + (lane / 16) * 8);
  };
  constexpr int QREG = MT == 1 ? KS : 1;  // MT = 1 keeps every k-step's Q in registers
  uint32_t qf[QREG][4];
  if constexpr (MT == 1) {
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) load_q(qf[ks], 0, ks);
  }

  float o[MT][NT][4];
  float m[MT][2], l[MT][2];
  int pos_q[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int j = 0; j < NT; ++j) o[mt][j][0] = o[mt][j][1] = o[mt][j][2] = o[mt][j][3] = 0.f;
    m[mt][0] = m[mt][1] = -INFINITY;
    l[mt][0] = l[mt][1] = 0.f;
    pos_q[mt][0] = first_pos + (warp * MT + mt) * 16 + g;
    pos_q[mt][1] = pos_q[mt][0] + 8;
  }

  int ring = 0;  // kRing: stage of tile i
  for (int i = 0; i < n_kt; ++i) {
    const int kt = kt_begin + i * kFaKeys;
    const int stage = kRing ? ring : (i & 1);
    if constexpr (kRing) {
      // Tile i has landed once at most ST - 2 younger groups are pending; after the barrier
      // every warp is done with tile i - 1, whose stage takes tile i + ST - 1 (so one barrier
      // per tile instead of two).
      cp_async_wait<ST - 2>();
      __syncthreads();
      if (i + ST - 1 < n_kt) {
        load_kv_pipe(kt + (ST - 1) * kFaKeys, ring == 0 ? ST - 1 : ring - 1, kph, vph);
        if (i + ST < n_kt) lookup(kt + ST * kFaKeys, kph, vph);
      }
      cp_async_commit();
      ring = ring + 1 == ST ? 0 : ring + 1;
    } else if (i + 1 < n_kt) {
      if constexpr (PIPE) {
        load_kv_pipe(kt + kFaKeys, stage ^ 1, kph, vph);
        if (i + 2 < n_kt) lookup(kt + 2 * kFaKeys, kph, vph);
      } else {
        load_kv(kt + kFaKeys, stage ^ 1);
      }
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    if constexpr (!kRing) __syncthreads();
    const T* k_s = reinterpret_cast<const T*>(smem_raw + L::K_OFF + stage * L::K_BYTES);
    T* v_s = reinterpret_cast<T*>(smem_raw + L::V_OFF + stage * L::V_BYTES);

    // Zero the keys outside [kv_lo, kv_hi) of the (at most two) V vectors straddling an edge.
    const int lo_vec = (kv_lo / 8) * 8, hi_vec = (kv_hi / 8) * 8;
    const bool fix_lo = kv_lo % 8 != 0 && lo_vec >= kt && lo_vec < kt + kFaKeys;
    const bool fix_hi = kv_hi % 8 != 0 && hi_vec >= kt && hi_vec < kt + kFaKeys &&
                        !(fix_lo && hi_vec == lo_vec);
    if (fix_lo || fix_hi) {
      for (int e = tid; e < 2 * HEAD; e += kFaThreads) {
        const int which = e / HEAD, d = e % HEAD;
        if (which == 0 ? !fix_lo : !fix_hi) continue;
        const int vec = which == 0 ? lo_vec : hi_vec;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          if (vec + j < kv_lo || vec + j >= kv_hi) {
            v_s[d * L::LDV + vec - kt + j] = from_float<T>(0.f);
          }
        }
      }
      __syncthreads();
    }

    // WMASK: this warp's rows (padding rows count as the last real one); warp_skip: every
    // score of those rows is masked in this tile, or the warp holds only padding rows.
    const int wfirst = first_pos + warp * MT * 16;
    const int wlast = min(wfirst + MT * 16 - 1, last_pos);
    bool warp_skip = false;
    if constexpr (WMASK) {
      warp_skip = wfirst > last_pos || (p.causal && kt > wlast) ||
                  (p.window > 0 && kt + kFaKeys - 1 <= wfirst - p.window);
    }
    if (!warp_skip) {
      // S = Q K^T: 16 * MT rows x KN keys per warp (NS n-tiles per m-tile).
      float s[MT][NS][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int j = 0; j < NS; ++j) s[mt][j][0] = s[mt][j][1] = s[mt][j][2] = s[mt][j][3] = 0.f;
      }
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        uint32_t qk[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          if constexpr (MT == 1) {
#pragma unroll
            for (int x = 0; x < 4; ++x) qk[mt][x] = qf[ks][x];
          } else {
            load_q(qk[mt], mt, ks);
          }
        }
#pragma unroll
        for (int j = 0; j < NS; j += 2) {
          uint32_t r[4];
          const int key = (j + lane / 16) * 8 + lane % 8;
          ldmatrix_x4(r, k_s + key * L::LDK + ks * 16 + (lane / 8 % 2) * 8);
          const uint32_t b0[2] = {r[0], r[1]};
          const uint32_t b1[2] = {r[2], r[3]};
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma_acc<T>(s[mt][j], qk[mt], b0);
            mma_acc<T>(s[mt][j + 1], qk[mt], b1);
          }
        }
      }

      // Online softmax in registers; rows g (r = 0) and g + 8 (r = 1). need_mask: some score of
      // the tile is masked for some row of the block (WMASK: of the warp).
      bool need_mask = kt < kv_lo || kt + kFaKeys > kv_hi ||
                       (p.causal && kt + kFaKeys - 1 > first_pos) ||
                       (p.window > 0 && kt <= last_pos - p.window);
      if constexpr (WMASK) {
        need_mask = kt < kv_lo || kt + kFaKeys > kv_hi || (p.causal && kt + kFaKeys - 1 > wfirst) ||
                    (p.window > 0 && kt <= wlast - p.window);
      }
      if constexpr (FAST) {
        // FAST: unmasked plain tiles (the bulk of a long prompt) take a straight-line path
        // (no per-score branches, exp2 of one FMA); rows whose max did not move have
        // alpha == 1 exactly, so O is rescaled only when some row of the warp needs it.
        float alpha[MT][2];
        if (plain && !need_mask && scale_log2 > 0.f) {
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              float mx = s[mt][0][2 * r];
#pragma unroll
              for (int j = 0; j < NS; ++j) {
                mx = fmaxf(mx, fmaxf(s[mt][j][2 * r], s[mt][j][2 * r + 1]));
              }
              mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
              mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
              const float m_new = fmaxf(m[mt][r], mx * scale_log2);  // finite: all visible
              alpha[mt][r] = fast_exp2(m[mt][r] - m_new);           // exp2(-inf) = 0
              float sum = 0.f;
#pragma unroll
              for (int j = 0; j < NS; ++j) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                  const float pv = fast_exp2(fmaf(s[mt][j][2 * r + e], scale_log2, -m_new));
                  s[mt][j][2 * r + e] = pv;
                  sum += pv;
                }
              }
              l[mt][r] = l[mt][r] * alpha[mt][r] + sum;
              m[mt][r] = m_new;
            }
          }
        } else if (PMASK && plain && scale_log2 > 0.f) {
          // PMASK: a masked tile without ALiBi / soft-cap: each row's visible keys are one
          // range [lo, hi) (edges, causal, window), so one select per score, no branches.
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              const int pq = pos_q[mt][r];
              const int lo = p.window > 0 ? max(kv_lo, pq - p.window + 1) : kv_lo;
              const int hi = p.causal ? min(kv_hi, pq + 1) : kv_hi;
              float mx = -INFINITY;
#pragma unroll
              for (int j = 0; j < NS; ++j) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                  const int pos_k = kt + 8 * j + 2 * t + e;
                  const float v = pos_k >= lo && pos_k < hi ? s[mt][j][2 * r + e] : -INFINITY;
                  s[mt][j][2 * r + e] = v;
                  mx = fmaxf(mx, v);
                }
              }
              mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
              mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
              const float m_new = fmaxf(m[mt][r], mx * scale_log2);  // -inf: nothing seen yet
              alpha[mt][r] = m_new == -INFINITY ? 1.f : fast_exp2(m[mt][r] - m_new);
              const float m_use = m_new == -INFINITY ? 0.f : m_new;
              float sum = 0.f;
#pragma unroll
              for (int j = 0; j < NS; ++j) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                  const float pv = fast_exp2(fmaf(s[mt][j][2 * r + e], scale_log2, -m_use));
                  s[mt][j][2 * r + e] = pv;  // exp2(-inf) = 0
                  sum += pv;
                }
              }
              l[mt][r] = l[mt][r] * alpha[mt][r] + sum;
              m[mt][r] = m_new;
            }
          }
        } else {
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              float mx = -INFINITY;
#pragma unroll
              for (int j = 0; j < NS; ++j) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                  const int pos_k = kt + 8 * j + 2 * t + e;
                  const int pq = pos_q[mt][r];
                  float v = s[mt][j][2 * r + e];
                  v = plain ? v * scale_log2
                            : kLog2e * transform_score(v, p.scale, p.soft_cap, slope, pos_k, pq);
                  if (need_mask) {
                    bool vis = pos_k >= kv_lo && pos_k < kv_hi;
                    if (p.causal) vis = vis && pos_k <= pq;
                    if (p.window > 0) vis = vis && pq - pos_k < p.window;
                    v = vis ? v : -INFINITY;
                  }
                  s[mt][j][2 * r + e] = v;
                  mx = fmaxf(mx, v);
                }
              }
              mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
              mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
              const float m_new = fmaxf(m[mt][r], mx);
              alpha[mt][r] = m_new == -INFINITY ? 1.f : fast_exp2(m[mt][r] - m_new);
              const float m_use = m_new == -INFINITY ? 0.f : m_new;
              float sum = 0.f;
#pragma unroll
              for (int j = 0; j < NS; ++j) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                  const float pv = fast_exp2(s[mt][j][2 * r + e] - m_use);  // exp2(-inf) = 0
                  s[mt][j][2 * r + e] = pv;
                  sum += pv;
                }
              }
              l[mt][r] = l[mt][r] * alpha[mt][r] + sum;
              m[mt][r] = m_new;
            }
          }
        }
        bool moved = false;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) moved = moved || alpha[mt][0] != 1.f || alpha[mt][1] != 1.f;
        if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int j = 0; j < NT; ++j) {
              o[mt][j][0] *= alpha[mt][0];
              o[mt][j][1] *= alpha[mt][0];
              o[mt][j][2] *= alpha[mt][1];
              o[mt][j][3] *= alpha[mt][1];
            }
          }
        }
      } else {
    #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
    #pragma unroll
        for (int r = 0; r < 2; ++r) {
          float mx = -INFINITY;
    #pragma unroll
          for (int j = 0; j < NS; ++j) {
    #pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int pos_k = kt + 8 * j + 2 * t + e;
              const int pq = pos_q[mt][r];
              float v = s[mt][j][2 * r + e];
              v = plain ? v * scale_log2
                        : kLog2e * transform_score(v, p.scale, p.soft_cap, slope, pos_k, pq);
              if (need_mask) {
                bool vis = pos_k >= kv_lo && pos_k < kv_hi;
                if (p.causal) vis = vis && pos_k <= pq;
                if (p.window > 0) vis = vis && pq - pos_k < p.window;
                v = vis ? v : -INFINITY;
              }
              s[mt][j][2 * r + e] = v;
              mx = fmaxf(mx, v);
            }
          }
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          const float m_new = fmaxf(m[mt][r], mx);
          const float alpha = m_new == -INFINITY ? 1.f : fast_exp2(m[mt][r] - m_new);
          const float m_use = m_new == -INFINITY ? 0.f : m_new;
          float sum = 0.f;
    #pragma unroll
          for (int j = 0; j < NS; ++j) {
    #pragma unroll
            for (int e = 0; e < 2; ++e) {
              const float pv = fast_exp2(s[mt][j][2 * r + e] - m_use);  // exp2(-inf) = 0
              s[mt][j][2 * r + e] = pv;
              sum += pv;
            }
          }
          l[mt][r] = l[mt][r] * alpha + sum;
          m[mt][r] = m_new;
    #pragma unroll
          for (int j = 0; j < NT; ++j) {
            o[mt][j][2 * r] *= alpha;
            o[mt][j][2 * r + 1] *= alpha;
          }
        }
        }
      }

      // O += P V: k-steps of 16 keys; P's A fragment is S's C fragment of n-tiles 2kk, 2kk + 1.
#pragma unroll
      for (int kk = 0; kk < kFaKeys / 16; ++kk) {
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          a[mt][0] = pack2<T>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
          a[mt][1] = pack2<T>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
          a[mt][2] = pack2<T>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
          a[mt][3] = pack2<T>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
        }
#pragma unroll
        for (int n = 0; n < NT; n += 2) {
          uint32_t r[4];
          const int d = (n + lane / 16) * 8 + lane % 8;
          ldmatrix_x4(r, v_s + d * L::LDV + kk * 16 + (lane / 8 % 2) * 8);
          const uint32_t b0[2] = {r[0], r[1]};
          const uint32_t b1[2] = {r[2], r[3]};
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma_acc<T>(o[mt][n], a[mt], b0);
            mma_acc<T>(o[mt][n + 1], a[mt], b1);
          }
        }
      }
    }  // !warp_skip
    if constexpr (!kRing) __syncthreads();  // this stage is refilled by the next load
  }

  T* out = static_cast<T*>(p.out);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float lr = l[mt][r];
      lr += __shfl_xor_sync(0xffffffffu, lr, 1);
      lr += __shfl_xor_sync(0xffffffffu, lr, 2);
      const int row = (warp * MT + mt) * 16 + g + 8 * r;
      if (row >= rows) continue;
      const float inv = lr > 0.f ? 1.f / lr : 0.f;
      T* orow = out + static_cast<int64_t>(q_begin + row0 + row) * p.o_stride_t +
                static_cast<int64_t>(head) * p.o_stride_h + 2 * t;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        *reinterpret_cast<uint32_t*>(orow + 8 * j) =
            pack2<T>(o[mt][j][2 * r] * inv, o[mt][j][2 * r + 1] * inv);
      }
    }
  }
}

}  // namespace pagedcore
