// Cache write: scatter this step's K/V into the paged cache; slot -1 (padding) is skipped.
#include "dtype.cuh"
#include "params.h"

namespace pagedcore {
namespace {

// One thread block per token; threads stride over the token's Hkv * D elements. Each thread
// moves one element of K and one of V (the V layout transposes tokens and dims, so wider
// stores would not stay contiguous).
template <typename T>
__global__ void cache_write_kernel(CacheWriteParams p) {
  const int64_t t = blockIdx.x;
  const int64_t slot = p.slot_mapping[t];
  if (slot < 0) return;
  constexpr int X = vec_elems<T>();
  const int64_t block = slot / p.block_size;
  const int64_t off = slot % p.block_size;
  const int n = p.num_kv_heads * p.head_size;
  const T* key = static_cast<const T*>(p.key);
  const T* value = static_cast<const T*>(p.value);
  T* k_cache = static_cast<T*>(p.k_cache);
  T* v_cache = static_cast<T*>(p.v_cache);
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int h = i / p.head_size;
    const int d = i % p.head_size;
    const int64_t head_base = block * p.num_kv_heads + h;
    const int64_t k_idx =
        ((head_base * (p.head_size / X) + d / X) * p.block_size + off) * X + d % X;
    const int64_t v_idx = (head_base * p.head_size + d) * p.block_size + off;
    k_cache[k_idx] = key[t * p.key_stride_t + h * p.key_stride_h + d];
    v_cache[v_idx] = value[t * p.value_stride_t + h * p.value_stride_h + d];
  }
}

// fp8 cache: T is the model dtype, C the fp8 element; stores fp8(float(x) / scale) (round to
// nearest even, saturated), the layout's x being 16 elements.
template <typename T, typename C>
__global__ void cache_write_fp8_kernel(CacheWriteParams p) {
  const int64_t t = blockIdx.x;
  const int64_t slot = p.slot_mapping[t];
  if (slot < 0) return;
  constexpr int X = vec_elems<C>();
  const int64_t block = slot / p.block_size;
  const int64_t off = slot % p.block_size;
  const int n = p.num_kv_heads * p.head_size;
  const float k_scale = *p.k_scale, v_scale = *p.v_scale;
  const T* key = static_cast<const T*>(p.key);
  const T* value = static_cast<const T*>(p.value);
  C* k_cache = static_cast<C*>(p.k_cache);
  C* v_cache = static_cast<C*>(p.v_cache);
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int h = i / p.head_size;
    const int d = i % p.head_size;
    const int64_t head_base = block * p.num_kv_heads + h;
    const int64_t k_idx =
        ((head_base * (p.head_size / X) + d / X) * p.block_size + off) * X + d % X;
    const int64_t v_idx = (head_base * p.head_size + d) * p.block_size + off;
    k_cache[k_idx] =
        from_float<C>(__fdiv_rn(to_float(key[t * p.key_stride_t + h * p.key_stride_h + d]),
                                k_scale));
    v_cache[v_idx] = from_float<C>(
        __fdiv_rn(to_float(value[t * p.value_stride_t + h * p.value_stride_h + d]), v_scale));
  }
}

template <typename T, typename C>
cudaError_t launch_fp8(const CacheWriteParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  const int n = p.num_kv_heads * p.head_size;
  const int threads = n >= 512 ? 512 : ((n + 31) / 32) * 32;
  cache_write_fp8_kernel<T, C><<<p.num_tokens, threads, 0, stream>>>(p);
  return cudaGetLastError();
}

template <typename C>
cudaError_t launch_fp8_for(const CacheWriteParams& p, DType dtype, cudaStream_t stream) {
  switch (dtype) {
    case DType::kFloat16:
      return launch_fp8<__half, C>(p, stream);
    case DType::kBFloat16:
      return launch_fp8<__nv_bfloat16, C>(p, stream);
    case DType::kFloat32:
      return launch_fp8<float, C>(p, stream);
  }
  return cudaErrorInvalidValue;
}

template <typename T>
cudaError_t launch(const CacheWriteParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  const int n = p.num_kv_heads * p.head_size;
  const int threads = n >= 512 ? 512 : ((n + 31) / 32) * 32;
  cache_write_kernel<T><<<p.num_tokens, threads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_cache_write(const CacheWriteParams& p, DType dtype, cudaStream_t stream) {
  switch (dtype) {
    case DType::kFloat16:
      return launch<__half>(p, stream);
    case DType::kBFloat16:
      return launch<__nv_bfloat16>(p, stream);
    case DType::kFloat32:
      return launch<float>(p, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_cache_write_fp8(const CacheWriteParams& p, DType dtype, Fp8 kind,
                                   cudaStream_t stream) {
  return kind == Fp8::kE4M3 ? launch_fp8_for<__nv_fp8_e4m3>(p, dtype, stream)
                            : launch_fp8_for<__nv_fp8_e5m2>(p, dtype, stream);
}

}  // namespace pagedcore
