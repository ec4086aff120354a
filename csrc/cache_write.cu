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

}  // namespace pagedcore
