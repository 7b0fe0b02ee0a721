// Split-K decode attention, second pass: merge the key blocks of
// gqa_decode_partial.cu for each (b, query head): with M = max_j m_j (log2
// units) and w_j = exp2(m_j - M), out = sum_j w_j o_j / sum_j w_j l_j, in
// float32, rounded once to OutT. Blocks with no allowed key (m = -inf, l = 0)
// weigh 0.
//
// Launch: grid (D, Hq, B) threads, threadgroup (D, 1, 1): one block per
// (b, query head), one thread per output element. Inputs: o_part
// [B, Hq, NB, D], ml [B, Hq, NB, 2] float32. Output: out [B, Hq, 1, D] OutT.

const int d = threadIdx.x;
const int hq = blockIdx.y;
const int b = blockIdx.z;
const int NB = ml_shape[2];
const size_t row = ((size_t)b * gridDim.y + hq) * NB;
float M = -INFINITY;
for (int j = 0; j < NB; ++j) M = fmaxf(M, ml[(row + j) * 2]);
float num = 0.f, den = 0.f;
for (int j = 0; j < NB; ++j) {
  const float mj = ml[(row + j) * 2];
  if (mj == -INFINITY) continue;
  const float w = exp2f(mj - M);
  den += w * ml[(row + j) * 2 + 1];
  num += w * o_part[(row + j) * D + d];
}
out[((size_t)b * gridDim.y + hq) * D + d] = static_cast<OutT>(num / den);
