// The last step of the tensor-core decodes (decode_mma.cuh, decode_fp8_keys.cuh): merging the
// thread block's warps' partial softmax states and writing the result.
#pragma once
#include "decode.cuh"
#include "mma.cuh"

namespace pagedcore {

// `m_s` / `l_s` ([NW][ROWS]: running max in log2 units, sum) and `o_s` ([NW][ROWS][HEAD],
// unnormalized output) hold each warp's state for the block's `rows` query heads head0...;
// after a __syncthreads the block's threads merge the warps and write each head's output row
// (one partition) or its partition's partials (output, natural-log max, sum) for
// decode_reduce_kernel. `v_scale` multiplies the output (fp8 caches; 1 otherwise).
template <typename T, int HEAD, int ROWS, int NW>
__device__ __forceinline__ void write_merged_rows(const AttentionParams& p, const float* m_s,
                                                  const float* l_s, const float* o_s,
                                                  int rows, int head0, float v_scale,
                                                  const DecodeSpan& span, int item, int part,
                                                  int64_t q_tok) {
  for (int i = threadIdx.x; i < rows * HEAD; i += blockDim.x) {
    const int row = i / HEAD, d = i % HEAD;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < NW; ++w) mx = fmaxf(mx, m_s[w * ROWS + row]);
    float lsum = 0.f, acc = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      const float mw = m_s[w * ROWS + row];
      const float f = mw == -INFINITY ? 0.f : fast_exp2(mw - mx);
      lsum += f * l_s[w * ROWS + row];
      acc += f * o_s[(w * ROWS + row) * HEAD + d];
    }
    const float val = lsum > 0.f ? acc / lsum * v_scale : 0.f;
    const int head = head0 + row;
    if (span.num_parts == 1) {
      T* out = static_cast<T*>(p.out) + q_tok * p.o_stride_t +
               static_cast<int64_t>(head) * p.o_stride_h;
      out[d] = from_float<T>(val);
    } else {
      const int64_t prow =
          (static_cast<int64_t>(item) * p.num_heads + head) * p.max_partitions + part;
      p.tmp_out[prow * HEAD + d] = val;
      if (d == 0) {
        p.max_logits[prow] = mx == -INFINITY ? -INFINITY : mx / kLog2e;
        p.exp_sums[prow] = lsum;
      }
    }
  }
}

}  // namespace pagedcore
