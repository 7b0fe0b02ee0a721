// Split-K decode attention, second pass: merge the key blocks of
// gqa_decode_partial.cu for each (b, query head): with M = max_j m_j (log2
// units) and w_j = exp2(m_j - M), out = sum_j w_j o_j / sum_j w_j l_j, in
// float32, rounded once to OutT. Blocks with no allowed key (m = -inf, l = 0)
// weigh 0. With HAS_GATE, Qwen3-Next's output gate follows in the same
// launch, rounded as mlx-lm's `out * mx.sigmoid(gate)` in OutT: each step of
// MLX's sigmoid (y = 1 / (1 + exp(|x|)), x < 0 ? y : 1 - y) and the product
// rounded to OutT.
//
// Launch: grid (D, Hq, B) threads, threadgroup (D, 1, 1): one block per
// (b, query head), one thread per output element. Inputs: o_part
// [B, Hq, NB, D], ml [B, Hq, NB, 2] float32; gate [B, 1, Hq, D] OutT (any
// strides; read only if HAS_GATE). Output: out, B * Hq * D elements of OutT
// in (b, query head, d) order: [B, Hq, 1, D] or, gated, [B, 1, Hq * D].

const int d = threadIdx.x;
const int hq = blockIdx.y;
const int b = blockIdx.z;
const int NB = ml_shape[2];
const int64_t row = ((int64_t)b * gridDim.y + hq) * NB;
float M = -INFINITY;
for (int j = 0; j < NB; ++j) M = fmaxf(M, ml[(row + j) * 2]);
float num = 0.f, den = 0.f;
#pragma unroll 4
for (int j = 0; j < NB; ++j) {
  const float mj = ml[(row + j) * 2];
  const float w = mj == -INFINITY ? 0.f : exp2f(mj - M);
  den += w * ml[(row + j) * 2 + 1];
  num += w * o_part[(row + j) * D + d];
}
OutT y = static_cast<OutT>(num / den);
if (HAS_GATE) {
  const float x = static_cast<float>(
      gate[(int64_t)b * gate_strides[0] + (int64_t)hq * gate_strides[2] +
           (int64_t)d * gate_strides[3]]);
  const OutT e = static_cast<OutT>(expf(fabsf(x)));
  const OutT one_e = static_cast<OutT>(1.f + static_cast<float>(e));
  const OutT r = static_cast<OutT>(1.f / static_cast<float>(one_e));
  const OutT sg = x < 0.f ? r : static_cast<OutT>(1.f - static_cast<float>(r));
  y = static_cast<OutT>(static_cast<float>(y) * static_cast<float>(sg));
}
out[((int64_t)b * gridDim.y + hq) * D + d] = y;
