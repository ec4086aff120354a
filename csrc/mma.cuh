// Tensor-core building blocks for the FlashAttention-2 style kernels (decode_mma.cuh,
// prefill_mma.cuh): `mma.sync.m16n8k16` with fp32 accumulation, `ldmatrix`, `cp.async`.
//
// Fragment layout of m16n8k16 (g = lane / 4, t = lane % 4), all documented in the PTX ISA:
//   A (16x16, row-major), four 32-bit registers of two elements each:
//     a[0] = (row g,   cols 2t, 2t+1)   a[1] = (row g+8, cols 2t, 2t+1)
//     a[2] = (row g,   cols 2t+8, +9)   a[3] = (row g+8, cols 2t+8, +9)
//   B (16x8, "col"): b[0] = (rows 2t, 2t+1, col g)   b[1] = (rows 2t+8, 2t+9, col g)
//   C/D (16x8, fp32): c[0], c[1] = (row g, cols 2t, 2t+1)   c[2], c[3] = (row g+8, same cols)
// The lower half of each 32-bit register holds the lower column / row index.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace pagedcore {

// d = a * b + c on tensor cores, fp16 or bf16 inputs, fp32 accumulation.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4],
                                          const uint32_t (&b)[2], const float (&c)[4]) {
  static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>,
                "mma_16816 takes fp16 or bf16 inputs");
  if constexpr (std::is_same_v<T, __half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%10,%11,%12,%13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]),
          "f"(c[1]), "f"(c[2]), "f"(c[3]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%10,%11,%12,%13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]),
          "f"(c[1]), "f"(c[2]), "f"(c[3]));
  }
}

// In-place accumulate: c += a * b.
template <typename T>
__device__ __forceinline__ void mma_acc(float (&c)[4], const uint32_t (&a)[4],
                                        const uint32_t (&b)[2]) {
  mma_16816<T>(c, a, b, c);
}

// Two floats packed as one 32-bit register of T (lo in the lower half).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, __half>) {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

// Zeroes the 16-bit halves of `v` whose mask bit is clear (bit 0 = lower half).
__device__ __forceinline__ uint32_t keep_halves(uint32_t v, bool lo, bool hi) {
  return v & ((lo ? 0x0000ffffu : 0u) | (hi ? 0xffff0000u : 0u));
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Four 8x8 b16 matrices from shared memory; lane i gives the address of row i % 8 of matrix
// i / 8 and receives, of each matrix, row lane / 4, columns 2 (lane % 4) and +1.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row_ptr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row_ptr)));
}

// 16-byte global -> shared copy that bypasses registers; `valid` false writes zeros instead.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)),
               "l"(gmem), "r"(bytes));
}

// 8-byte variant (cache-all: the .cg form takes 16 bytes only).
__device__ __forceinline__ void cp_async_8(void* smem, const void* gmem, bool valid) {
  const int bytes = valid ? 8 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(smem_addr(smem)),
               "l"(gmem), "r"(bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Eight T values (one 16-byte vector) as eight M values: the same registers when M is T,
// rounded to fp16 otherwise.
template <typename T, typename M>
__device__ __forceinline__ uint4 as_mma_type(const uint4& v) {
  if constexpr (std::is_same_v<T, M>) {
    return v;
  } else {
    static_assert(std::is_same_v<M, __half>, "mma inputs are T or fp16");
    uint4 r;
    const uint32_t* src = &v.x;
    uint32_t* dst = &r.x;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(src + i));
      const __half2 h = __floats2half2_rn(f.x, f.y);
      dst[i] = *reinterpret_cast<const uint32_t*>(&h);
    }
    return r;
  }
}

constexpr float kLog2e = 1.4426950408889634f;

// 2^x on the special-function unit (ex2.approx.ftz: 2^-inf = 0, rel. error ~2^-22).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace pagedcore
