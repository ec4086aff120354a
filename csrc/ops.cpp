// Torch bindings of the cuda_paged kernels: argument checks, dtype dispatch, stream selection.
// Built as the extension `pagedcore_cuda_paged._C`.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <optional>

#include "params.h"

namespace pagedcore {
namespace {

DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kHalf:
      return DType::kFloat16;
    case at::kBFloat16:
      return DType::kBFloat16;
    case at::kFloat:
      return DType::kFloat32;
    default:
      break;
  }
  TORCH_CHECK(false, "cuda_paged supports float16, bfloat16 and float32 tensors, got ",
              t.scalar_type(), "; cast the model to one of them");
  return DType::kFloat32;
}

void check_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got one on ", t.device());
}

void check_int32(const at::Tensor& t, const char* name) {
  check_cuda(t, name);
  TORCH_CHECK(t.scalar_type() == at::kInt, name, " must be int32, got ", t.scalar_type());
  TORCH_CHECK(t.stride(-1) == 1, name, " must be contiguous in its last dimension");
}

void check_rows(const at::Tensor& t, const char* name) {
  // [T, H, D] with unit last stride and 16-byte aligned rows (the kernels load 16-byte vectors).
  TORCH_CHECK(t.dim() == 3, name, " must be [tokens, heads, head_size], got ", t.sizes());
  TORCH_CHECK(t.stride(2) == 1, name, " must be contiguous in head_size; call .contiguous()");
  const int64_t e = t.element_size();
  TORCH_CHECK((t.stride(0) * e) % 16 == 0 && (t.stride(1) * e) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0,
              name, " rows must be 16-byte aligned; call .contiguous()");
}

// `head_size` < 0: the launch has no size dispatch (cache write).
void check_cuda_status(cudaError_t err, const char* what, int64_t head_size) {
  TORCH_CHECK(err != cudaErrorInvalidValue || head_size < 0, what, ": head size ", head_size,
              " or the block size is not compiled in (head sizes 64, 80, 96, 112, 128, 256; "
              "block sizes 8, 16, 32)");
  TORCH_CHECK(err == cudaSuccess, what, " failed: ", cudaGetErrorString(err));
}

using LaunchFn = cudaError_t (*)(const AttentionParams&, int, cudaStream_t);

// Runs the launcher matching the query's dtype on the current stream of its device.
void launch_for_dtype(const AttentionParams& p, const at::Tensor& query, LaunchFn f16,
                      LaunchFn bf16, LaunchFn f32, const char* what) {
  const c10::cuda::CUDAGuard guard(query.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const int64_t head_size = query.size(2);
  LaunchFn launch = nullptr;
  switch (dtype_of(query)) {
    case DType::kFloat16:
      launch = f16;
      break;
    case DType::kBFloat16:
      launch = bf16;
      break;
    case DType::kFloat32:
      launch = f32;
      break;
  }
  const cudaError_t err =
      launch == nullptr ? cudaErrorInvalidValue : launch(p, static_cast<int>(head_size), stream);
  check_cuda_status(err, what, head_size);
}

// K and V views inside the single per-layer tensor [2, num_blocks, Hkv * D * B].
std::pair<void*, void*> kv_pointers(const at::Tensor& kv_cache) {
  TORCH_CHECK(kv_cache.dim() == 3 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be a contiguous [2, num_blocks, num_kv_heads * head_size * "
              "block_size] tensor from get_kv_cache_shape, got ", kv_cache.sizes());
  char* base = static_cast<char*>(kv_cache.data_ptr());
  return {base, base + kv_cache.stride(0) * kv_cache.element_size()};
}

AttentionParams common_params(const at::Tensor& out, const at::Tensor& query,
                              const at::Tensor& kv_cache, const at::Tensor& block_table,
                              const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                              const at::Tensor& work, int64_t block_size, int64_t num_kv_heads,
                              double scale, double soft_cap,
                              const std::optional<at::Tensor>& alibi_slopes, int64_t window) {
  check_cuda(query, "query");
  check_cuda(kv_cache, "kv_cache");
  check_rows(query, "query");
  check_rows(out, "output");
  TORCH_CHECK(out.sizes() == query.sizes(), "output must have the query's shape ",
              query.sizes(), ", got ", out.sizes());
  const bool fp8_cache = kv_cache.scalar_type() == at::kFloat8_e4m3fn ||
                         kv_cache.scalar_type() == at::kFloat8_e5m2;
  TORCH_CHECK((fp8_cache || query.scalar_type() == kv_cache.scalar_type()) &&
                  out.scalar_type() == query.scalar_type(),
              "query, output and kv_cache must share one dtype (got ", query.scalar_type(), ", ",
              out.scalar_type(), ", ", kv_cache.scalar_type(), ")");
  check_int32(block_table, "block_table");
  check_int32(seq_lens, "seq_lens");
  check_int32(query_start_loc, "query_start_loc");
  check_int32(work, "work");
  const int64_t num_heads = query.size(1);
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "num_heads (", num_heads,
              ") must be a multiple of num_kv_heads (", num_kv_heads, ")");
  auto [k_ptr, v_ptr] = kv_pointers(kv_cache);
  TORCH_CHECK(kv_cache.size(2) == num_kv_heads * query.size(2) * block_size,
              "kv_cache's last dim ", kv_cache.size(2), " != num_kv_heads * head_size * "
              "block_size = ", num_kv_heads * query.size(2) * block_size);
  AttentionParams p{};
  p.out = out.data_ptr();
  p.query = query.data_ptr();
  p.k_cache = k_ptr;
  p.v_cache = v_ptr;
  p.block_table = block_table.data_ptr<int>();
  p.block_table_stride = block_table.stride(0);
  p.seq_lens = seq_lens.data_ptr<int>();
  p.query_start_loc = query_start_loc.data_ptr<int>();
  p.work = work.data_ptr<int>();
  p.q_stride_t = query.stride(0);
  p.q_stride_h = query.stride(1);
  p.o_stride_t = out.stride(0);
  p.o_stride_h = out.stride(1);
  p.num_heads = static_cast<int>(num_heads);
  p.num_kv_heads = static_cast<int>(num_kv_heads);
  p.block_size = static_cast<int>(block_size);
  p.scale = static_cast<float>(scale);
  p.soft_cap = static_cast<float>(soft_cap);
  p.window = static_cast<int>(window);
  p.causal = true;
  p.alibi_slopes = nullptr;
  if (alibi_slopes.has_value()) {
    const at::Tensor& a = *alibi_slopes;
    check_cuda(a, "alibi_slopes");
    TORCH_CHECK(a.scalar_type() == at::kFloat && a.is_contiguous() && a.numel() == num_heads,
                "alibi_slopes must be a contiguous float32 tensor of num_heads (", num_heads,
                ") entries");
    p.alibi_slopes = a.data_ptr<float>();
  }
  return p;
}

// The fp8 format of an fp8 cache tensor (torch.float8_e4m3fn / float8_e5m2).
Fp8 fp8_of(const at::Tensor& kv_cache) {
  if (kv_cache.scalar_type() == at::kFloat8_e4m3fn) return Fp8::kE4M3;
  TORCH_CHECK(kv_cache.scalar_type() == at::kFloat8_e5m2, "the fp8 ops take a "
              "float8_e4m3fn or float8_e5m2 kv_cache, got ", kv_cache.scalar_type());
  return Fp8::kE5M2;
}

// A [1] float32 CUDA tensor (a layer's k_scale / v_scale) as a device pointer.
const float* scale_ptr(const at::Tensor& t, const char* name) {
  check_cuda(t, name);
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.numel() == 1, name,
              " must be a [1] float32 tensor, got ", t.scalar_type(), " ", t.sizes());
  return t.data_ptr<float>();
}

using Fp8LaunchFn = cudaError_t (*)(const AttentionParams&, int, Fp8, cudaStream_t);

void launch_fp8_for_dtype(const AttentionParams& p, const at::Tensor& query, Fp8 kind,
                          Fp8LaunchFn f16, Fp8LaunchFn bf16, Fp8LaunchFn f32, const char* what) {
  const c10::cuda::CUDAGuard guard(query.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const int64_t head_size = query.size(2);
  TORCH_CHECK(p.block_size == 16 || p.block_size == 32, what, ": an fp8 cache needs block "
              "size 16 or 32 (16 fp8 elements per 16-byte vector), got ", p.block_size);
  Fp8LaunchFn launch = nullptr;
  switch (dtype_of(query)) {
    case DType::kFloat16:
      launch = f16;
      break;
    case DType::kBFloat16:
      launch = bf16;
      break;
    case DType::kFloat32:
      launch = f32;
      break;
  }
  check_cuda_status(launch(p, static_cast<int>(head_size), kind, stream), what, head_size);
}

// The tensor-core fp8 decodes by query dtype (fp32 queries have none).
cudaError_t launch_decode_mma_fp8_f16(const AttentionParams& p, int head_size, Fp8 kind,
                                      cudaStream_t stream) {
  return kind == Fp8::kE4M3 ? launch_decode_mma_fp8_e4m3_f16(p, head_size, stream)
                            : launch_decode_mma_fp8_e5m2_f16(p, head_size, stream);
}
cudaError_t launch_decode_mma_fp8_bf16(const AttentionParams& p, int head_size, Fp8 kind,
                                       cudaStream_t stream) {
  return kind == Fp8::kE4M3 ? launch_decode_mma_fp8_e4m3_bf16(p, head_size, stream)
                            : launch_decode_mma_fp8_e5m2_bf16(p, head_size, stream);
}

}  // namespace

void cache_write(const at::Tensor& key, const at::Tensor& value, at::Tensor kv_cache,
                 const at::Tensor& slot_mapping, int64_t block_size) {
  check_cuda(key, "key");
  check_cuda(value, "value");
  check_cuda(slot_mapping, "slot_mapping");
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(),
              "key and value must both be [tokens, num_kv_heads, head_size], got ", key.sizes(),
              " and ", value.sizes());
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1,
              "key and value must be contiguous in head_size; call .contiguous()");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() >= key.size(0),
              "slot_mapping must be a contiguous int64 tensor with one entry per token");
  TORCH_CHECK(key.scalar_type() == kv_cache.scalar_type() &&
                  value.scalar_type() == kv_cache.scalar_type(),
              "key, value and kv_cache must share one dtype");
  auto [k_ptr, v_ptr] = kv_pointers(kv_cache);
  const int64_t head_size = key.size(2);
  const int64_t x = 16 / key.element_size();
  TORCH_CHECK(head_size % x == 0, "head_size ", head_size, " must be a multiple of ", x,
              " for the 16-byte K layout");
  TORCH_CHECK(kv_cache.size(2) == key.size(1) * head_size * block_size,
              "kv_cache's last dim ", kv_cache.size(2), " != num_kv_heads * head_size * "
              "block_size = ", key.size(1) * head_size * block_size);
  const c10::cuda::CUDAGuard guard(key.device());
  CacheWriteParams p{};
  p.key = key.data_ptr();
  p.value = value.data_ptr();
  p.k_cache = k_ptr;
  p.v_cache = v_ptr;
  p.slot_mapping = slot_mapping.data_ptr<int64_t>();
  p.key_stride_t = key.stride(0);
  p.key_stride_h = key.stride(1);
  p.value_stride_t = value.stride(0);
  p.value_stride_h = value.stride(1);
  p.num_tokens = static_cast<int>(key.size(0));
  p.num_kv_heads = static_cast<int>(key.size(1));
  p.head_size = static_cast<int>(head_size);
  p.block_size = static_cast<int>(block_size);
  check_cuda_status(
      launch_cache_write(p, dtype_of(key), c10::cuda::getCurrentCUDAStream().stream()),
      "cache_write", -1);
}

void decode(at::Tensor out, const at::Tensor& query, const at::Tensor& kv_cache,
            const at::Tensor& block_table, const at::Tensor& seq_lens,
            const at::Tensor& query_start_loc, const at::Tensor& decode_reqs,
            int64_t block_size, int64_t num_kv_heads, double scale, double soft_cap,
            const std::optional<at::Tensor>& alibi_slopes, int64_t window,
            int64_t partition_size, int64_t max_partitions, bool grouped,
            const at::Tensor& tmp_out, const at::Tensor& max_logits,
            const at::Tensor& exp_sums, int64_t kernel, int64_t unroll) {
  AttentionParams p =
      common_params(out, query, kv_cache, block_table, seq_lens, query_start_loc, decode_reqs,
                    block_size, num_kv_heads, scale, soft_cap, alibi_slopes, window);
  TORCH_CHECK(kv_cache.scalar_type() == query.scalar_type(),
              "decode reads a cache in the query's dtype; an fp8 cache goes to decode_fp8");
  TORCH_CHECK(partition_size > 0 && partition_size % block_size == 0,
              "partition_size ", partition_size, " must be a positive multiple of block_size ",
              block_size);
  TORCH_CHECK(max_partitions >= 1, "max_partitions must be >= 1");
  p.num_items = static_cast<int>(decode_reqs.numel());
  p.partition_size = static_cast<int>(partition_size);
  p.max_partitions = static_cast<int>(max_partitions);
  p.grouped = grouped;
  if (max_partitions > 1) {
    const int64_t rows = p.num_items * p.num_heads * max_partitions;
    TORCH_CHECK(tmp_out.scalar_type() == at::kFloat && tmp_out.numel() >= rows * query.size(2) &&
                    max_logits.numel() >= rows && exp_sums.numel() >= rows,
                "partition buffers are too small for ", rows, " partition rows");
    p.tmp_out = tmp_out.data_ptr<float>();
    p.max_logits = max_logits.data_ptr<float>();
    p.exp_sums = exp_sums.data_ptr<float>();
  }
  TORCH_CHECK(kernel == 0 || kernel == 1, "decode kernel must be 0 (classic) or 1 (mma), got ",
              kernel);
  if (kernel == 1) {
    TORCH_CHECK(query.scalar_type() != at::kFloat && query.size(2) <= 128,
                "the mma decode kernel takes float16/bfloat16 and head sizes 64-128, got ",
                query.scalar_type(), " and ", query.size(2), "; use the classic kernel");
    TORCH_CHECK(unroll >= 1 && unroll <= 3, "mma decode unroll must be 1, 2 (tiles loaded "
                "together into registers) or 3 (cp.async ring), got ", unroll);
    p.decode_unroll = static_cast<int>(unroll);
    launch_for_dtype(p, query, launch_decode_mma_f16, launch_decode_mma_bf16, nullptr,
                     "decode (mma)");
    return;
  }
  launch_for_dtype(p, query, launch_decode_f16, launch_decode_bf16, launch_decode_f32, "decode");
}

void prefill(at::Tensor out, const at::Tensor& query, const at::Tensor& kv_cache,
             const at::Tensor& block_table, const at::Tensor& seq_lens,
             const at::Tensor& query_start_loc, const at::Tensor& tiles, int64_t block_size,
             int64_t num_kv_heads, double scale, double soft_cap,
             const std::optional<at::Tensor>& alibi_slopes, int64_t window, bool causal,
             int64_t variant, int64_t tile_rows) {
  AttentionParams p =
      common_params(out, query, kv_cache, block_table, seq_lens, query_start_loc, tiles,
                    block_size, num_kv_heads, scale, soft_cap, alibi_slopes, window);
  TORCH_CHECK(kv_cache.scalar_type() == query.scalar_type(),
              "prefill reads a cache in the query's dtype; an fp8 cache goes to prefill_fp8");
  TORCH_CHECK(tiles.dim() == 2 && tiles.size(1) == 2 && tiles.is_contiguous(),
              "tiles must be a contiguous [num_tiles, 2] int32 tensor of (request, first row)");
  p.num_items = static_cast<int>(tiles.size(0));
  p.causal = causal;
  // Variants: 0 mma, 1 wmma, 2 wmma lane per key, 3 mma pipelined gather (64 or 128 rows),
  // 4 the same with 8 warps of 16 rows (128 rows), 5 with 32-key tiles (128 rows, 4 warps),
  // 6 with 32-key tiles and 8 warps of 32 rows (256 rows), 7 = 5 and 8 = 4 with three K/V
  // tiles in flight instead of two, 9 = 7 and 10 = 3 (128 rows) with the fast softmax,
  // 11 = 9 in head-major tile order with a 2-blocks-per-SM register bound, 12 = 11 with 64
  // rows (4 warps of 16 rows, Q in registers) and 3 blocks per SM, 13 = 11 with 4 stages,
  // 14 = 10 in head-major order with a 2-blocks-per-SM register bound, 15 = 10 and 16 = 14
  // with masks decided per warp (fully masked warps skip a tile), 17 = 15 with one barrier
  // per tile, 18 = 15 and 19 = 17 with the straight-line softmax of masked plain tiles.
  TORCH_CHECK(variant >= 0 && variant <= 19, "prefill variant must be 0 (mma), 1 (wmma), 2 "
              "(wmma, lane per key), 3 (mma, pipelined gather), 4 (3 with 8 warps), 5 (3 with "
              "32-key tiles), 6 (5 with 8 warps), 7 (5 with 3 stages), 8 (4 with 3 stages), "
              "9 (7 with the fast softmax), 10 (3 with the fast softmax), 11 (9, head-major), "
              "12 (11 with 64 rows), 13 (11 with 4 stages), 14 (10, head-major), 15 (10 with "
              "per-warp masks), 16 (14 with per-warp masks), 17 (15 with one barrier per "
              "tile), 18 (15 with straight-line masked plain tiles) or 19 (17 with them), got ",
              variant);
  const bool mma = variant == 0 || variant >= 3;
  const bool warps8 = variant == 4 || variant == 6 || variant == 8;
  const bool keys32 = variant == 5 || variant == 6 || variant == 7 || variant == 9 ||
                      (variant >= 11 && variant <= 13);
  const int64_t want_rows = variant == 6 ? 256 : variant == 12 ? 64 : variant >= 4 ? 128 : 0;
  if (want_rows != 0) {
    TORCH_CHECK(tile_rows == want_rows, "prefill variant ", variant, " takes tiles of ",
                want_rows, " query rows, got ", tile_rows);
  } else {
    TORCH_CHECK(tile_rows == 64 || (mma && tile_rows == 128), "prefill tiles must have ",
                "64 query rows (128 with the mma kernel), got ", tile_rows);
  }
  if (mma) {
    TORCH_CHECK(query.scalar_type() != at::kFloat && query.size(2) <= 128,
                "the mma prefill kernel takes float16/bfloat16 and head sizes 64-128, got ",
                query.scalar_type(), " and ", query.size(2), "; use variant 1 (wmma)");
    p.prefill_rows = static_cast<int>(tile_rows);
    p.prefill_pipe = variant >= 3;
    p.prefill_warps = warps8 ? 8 : 4;
    p.prefill_keys = keys32 ? 32 : 64;
    p.prefill_stages = variant == 13 ? 4 : variant == 7 || variant == 8 || variant == 9 ||
                       variant == 11 || variant == 12 ? 3 : 2;
    p.prefill_fast = variant >= 9;
    p.prefill_sched = variant >= 11 && variant <= 16 && variant != 15;
    p.prefill_warp_mask = variant >= 15;
    p.prefill_one_barrier = variant == 17 || variant == 19;
    p.prefill_plain_mask = variant >= 18;
    launch_for_dtype(p, query, launch_prefill_mma_f16, launch_prefill_mma_bf16, nullptr,
                     "prefill (mma)");
    return;
  }
  p.prefill_lane_per_key = variant == 2;
  launch_for_dtype(p, query, launch_prefill_f16, launch_prefill_bf16, launch_prefill_f32,
                   "prefill");
}

void cache_write_fp8(const at::Tensor& key, const at::Tensor& value, at::Tensor kv_cache,
                     const at::Tensor& slot_mapping, int64_t block_size,
                     const at::Tensor& k_scale, const at::Tensor& v_scale) {
  check_cuda(key, "key");
  check_cuda(value, "value");
  check_cuda(slot_mapping, "slot_mapping");
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(),
              "key and value must both be [tokens, num_kv_heads, head_size], got ", key.sizes(),
              " and ", value.sizes());
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1,
              "key and value must be contiguous in head_size; call .contiguous()");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() >= key.size(0),
              "slot_mapping must be a contiguous int64 tensor with one entry per token");
  TORCH_CHECK(key.scalar_type() == value.scalar_type(), "key and value must share one dtype");
  const Fp8 kind = fp8_of(kv_cache);
  auto [k_ptr, v_ptr] = kv_pointers(kv_cache);
  const int64_t head_size = key.size(2);
  TORCH_CHECK(head_size % 16 == 0 && block_size % 16 == 0, "an fp8 cache needs head_size (",
              head_size, ") and block_size (", block_size, ") to be multiples of 16");
  TORCH_CHECK(kv_cache.size(2) == key.size(1) * head_size * block_size,
              "kv_cache's last dim ", kv_cache.size(2), " != num_kv_heads * head_size * "
              "block_size = ", key.size(1) * head_size * block_size);
  const c10::cuda::CUDAGuard guard(key.device());
  CacheWriteParams p{};
  p.key = key.data_ptr();
  p.value = value.data_ptr();
  p.k_cache = k_ptr;
  p.v_cache = v_ptr;
  p.slot_mapping = slot_mapping.data_ptr<int64_t>();
  p.key_stride_t = key.stride(0);
  p.key_stride_h = key.stride(1);
  p.value_stride_t = value.stride(0);
  p.value_stride_h = value.stride(1);
  p.num_tokens = static_cast<int>(key.size(0));
  p.num_kv_heads = static_cast<int>(key.size(1));
  p.head_size = static_cast<int>(head_size);
  p.block_size = static_cast<int>(block_size);
  p.k_scale = scale_ptr(k_scale, "k_scale");
  p.v_scale = scale_ptr(v_scale, "v_scale");
  check_cuda_status(launch_cache_write_fp8(p, dtype_of(key), kind,
                                           c10::cuda::getCurrentCUDAStream().stream()),
                    "cache_write_fp8", -1);
}

void decode_fp8(at::Tensor out, const at::Tensor& query, const at::Tensor& kv_cache,
                const at::Tensor& block_table, const at::Tensor& seq_lens,
                const at::Tensor& query_start_loc, const at::Tensor& decode_reqs,
                int64_t block_size, int64_t num_kv_heads, double scale, double soft_cap,
                const std::optional<at::Tensor>& alibi_slopes, int64_t window,
                int64_t partition_size, int64_t max_partitions, const at::Tensor& tmp_out,
                const at::Tensor& max_logits, const at::Tensor& exp_sums,
                const at::Tensor& k_scale, const at::Tensor& v_scale, int64_t kernel) {
  const Fp8 kind = fp8_of(kv_cache);
  AttentionParams p =
      common_params(out, query, kv_cache, block_table, seq_lens, query_start_loc, decode_reqs,
                    block_size, num_kv_heads, scale, soft_cap, alibi_slopes, window);
  TORCH_CHECK(partition_size > 0 && partition_size % block_size == 0,
              "partition_size ", partition_size, " must be a positive multiple of block_size ",
              block_size);
  TORCH_CHECK(max_partitions >= 1, "max_partitions must be >= 1");
  p.num_items = static_cast<int>(decode_reqs.numel());
  p.partition_size = static_cast<int>(partition_size);
  p.max_partitions = static_cast<int>(max_partitions);
  p.grouped = false;
  p.k_scale = scale_ptr(k_scale, "k_scale");
  p.v_scale = scale_ptr(v_scale, "v_scale");
  if (max_partitions > 1) {
    const int64_t rows = p.num_items * p.num_heads * max_partitions;
    TORCH_CHECK(tmp_out.scalar_type() == at::kFloat && tmp_out.numel() >= rows * query.size(2) &&
                    max_logits.numel() >= rows && exp_sums.numel() >= rows,
                "partition buffers are too small for ", rows, " partition rows");
    p.tmp_out = tmp_out.data_ptr<float>();
    p.max_logits = max_logits.data_ptr<float>();
    p.exp_sums = exp_sums.data_ptr<float>();
  }
  TORCH_CHECK(kernel == 0 || kernel == 1, "decode_fp8 kernel must be 0 (classic) or 1 (mma), "
              "got ", kernel);
  if (kernel == 1) {
    const int64_t head = query.size(2);
    TORCH_CHECK(query.scalar_type() != at::kFloat && head % 16 == 0 && head >= 64 && head <= 128,
                "the mma fp8 decode takes float16/bfloat16 queries and head sizes 64-128, got ",
                query.scalar_type(), " and ", head, "; use the classic kernel");
    p.decode_unroll = 1;  // one load schedule: two tiles in flight per warp
    launch_fp8_for_dtype(p, query, kind, launch_decode_mma_fp8_f16, launch_decode_mma_fp8_bf16,
                         nullptr, "decode_fp8 (mma)");
    return;
  }
  launch_fp8_for_dtype(p, query, kind, launch_decode_fp8_f16, launch_decode_fp8_bf16,
                       launch_decode_fp8_f32, "decode_fp8");
}

void prefill_fp8(at::Tensor out, const at::Tensor& query, const at::Tensor& kv_cache,
                 const at::Tensor& block_table, const at::Tensor& seq_lens,
                 const at::Tensor& query_start_loc, const at::Tensor& tiles, int64_t block_size,
                 int64_t num_kv_heads, double scale, double soft_cap,
                 const std::optional<at::Tensor>& alibi_slopes, int64_t window, bool causal,
                 const at::Tensor& k_scale, const at::Tensor& v_scale) {
  const Fp8 kind = fp8_of(kv_cache);
  AttentionParams p =
      common_params(out, query, kv_cache, block_table, seq_lens, query_start_loc, tiles,
                    block_size, num_kv_heads, scale, soft_cap, alibi_slopes, window);
  TORCH_CHECK(tiles.dim() == 2 && tiles.size(1) == 2 && tiles.is_contiguous(),
              "tiles must be a contiguous [num_tiles, 2] int32 tensor of (request, first row)");
  p.num_items = static_cast<int>(tiles.size(0));
  p.causal = causal;
  p.prefill_lane_per_key = false;
  p.k_scale = scale_ptr(k_scale, "k_scale");
  p.v_scale = scale_ptr(v_scale, "v_scale");
  launch_fp8_for_dtype(p, query, kind, launch_prefill_fp8_f16, launch_prefill_fp8_bf16,
                       launch_prefill_fp8_f32, "prefill_fp8");
}

}  // namespace pagedcore

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "cuda_paged kernels: cache write, paged decode (one pass / partitioned), prefill";
  m.def("cache_write", &pagedcore::cache_write, "Scatter K/V into the paged cache");
  m.def("decode", &pagedcore::decode, "Paged decode attention");
  m.def("prefill", &pagedcore::prefill, "Paged prefill / chunked-prefill attention");
  m.def("cache_write_fp8", &pagedcore::cache_write_fp8,
        "Quantize K/V to fp8 and scatter them into the paged cache");
  m.def("decode_fp8", &pagedcore::decode_fp8, "Paged decode attention over an fp8 cache");
  m.def("prefill_fp8", &pagedcore::prefill_fp8,
        "Paged prefill / chunked-prefill attention over an fp8 cache (64-row tiles)");
  m.def("decode_smem_bytes", &pagedcore::decode_smem_bytes,
        "Dynamic shared memory of one per-head decode thread block");
  m.def("decode_mma_smem_bytes", &pagedcore::decode_mma_smem_bytes,
        "Dynamic shared memory of one mma decode thread block");
  m.def("decode_grouped_smem_bytes", &pagedcore::decode_grouped_smem_bytes,
        "Dynamic shared memory of one grouped decode thread block");
}
