// Element conversions and 16-byte vector loads shared by the kernels.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace pagedcore {

template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}

// fp8 cache elements widen exactly (every e4m3 / e5m2 value is a float16, bfloat16 and float32
// value); the dequantization scale is applied by the kernel, once per score / output row.
template <>
__device__ __forceinline__ float to_float<__nv_fp8_e4m3>(__nv_fp8_e4m3 v) {
  return static_cast<float>(v);
}
template <>
__device__ __forceinline__ float to_float<__nv_fp8_e5m2>(__nv_fp8_e5m2 v) {
  return static_cast<float>(v);
}

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// fp8 quantization of a cache write: round to nearest even, saturated to the largest finite
// value (NaN stays NaN), the contract of pagedcore.attention.kv_quant.
template <>
__device__ __forceinline__ __nv_fp8_e4m3 from_float<__nv_fp8_e4m3>(float v) {
  __nv_fp8_e4m3 r;
  r.__x = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
  return r;
}
template <>
__device__ __forceinline__ __nv_fp8_e5m2 from_float<__nv_fp8_e5m2>(float v) {
  __nv_fp8_e5m2 r;
  r.__x = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E5M2);
  return r;
}

// Whether T is one of the fp8 cache dtypes.
template <typename T>
__host__ __device__ constexpr bool is_fp8() { return sizeof(T) == 1; }

// Elements per 16-byte vector: the `x` of the K layout.
template <typename T>
__host__ __device__ constexpr int vec_elems() { return 16 / static_cast<int>(sizeof(T)); }

// Loads one 16-byte vector (x elements) and widens it to float.
template <typename T>
__device__ __forceinline__ void load_vec(const T* src, float (&dst)[16 / sizeof(T)]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(src);
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < vec_elems<T>(); ++i) dst[i] = to_float(e[i]);
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int m = 16; m >= 1; m /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, m));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int m = 16; m >= 1; m /= 2) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}

// Block-wide reductions over NWARPS warps; `scratch` holds at least 32 floats. Every thread
// gets the result. Ends with a barrier so `scratch` can be reused at once.
template <int NWARPS>
__device__ __forceinline__ float block_max(float v, float* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  v = warp_max(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < NWARPS ? scratch[lane] : -INFINITY;
  v = warp_max(v);
  __syncthreads();
  return v;
}

template <int NWARPS>
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  v = warp_sum(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < NWARPS ? scratch[lane] : 0.f;
  v = warp_sum(v);
  __syncthreads();
  return v;
}

__device__ __forceinline__ int cdiv(int a, int b) { return (a + b - 1) / b; }

// Score transform shared by decode and prefill: scale, soft-cap, then ALiBi.
__device__ __forceinline__ float transform_score(float dot, float scale, float soft_cap,
                                                 float slope, int pos_k, int pos_q) {
  float s = dot * scale;
  if (soft_cap > 0.f) s = soft_cap * tanhf(s / soft_cap);
  return s + slope * static_cast<float>(pos_k - pos_q);
}

}  // namespace pagedcore
