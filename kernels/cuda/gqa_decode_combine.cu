// Split-K decode attention, second pass: merge the key blocks of
// gqa_decode_partial.cu for each (b, query head): with M = max_j m_j (log2
// units) and w_j = exp2(m_j - M), out = sum_j w_j o_j / sum_j w_j l_j, in
// float32, rounded once to OutT. Blocks with no allowed key (m = -inf, l = 0)
// weigh 0; a head with no allowed key at all gives NaN (0 / 0; never in
// decode, where the new key is allowed). With HAS_GATE, Qwen3-Next's output gate follows in the same
// launch, rounded as mlx-lm's `out * mx.sigmoid(gate)` in OutT (common.cuh's
// qab_sigmoid_gate).
//
// One thread block per (b, query head) of W = blockDim.x / 32 warps (at most
// 16): warp w merges blocks w, w + W, ... two at a time (both blocks' loads
// in flight), lane i holding the D / 32 elements i * D / 32 .. of o; the W
// partial merges meet in shared memory and warp 0 writes the output.
//
// Launch: grid (32 * W, Hq, B) threads, threadgroup (32 * W, 1, 1). Inputs:
// o_part [B, Hq, NB, D], ml [B, Hq, NB, 2] float32; gate [B, 1, Hq, D] OutT
// (any strides; read only if HAS_GATE). Output: out, B * Hq * D elements of
// OutT in (b, query head, d) order: [B, Hq, 1, D] or, gated, [B, 1, Hq * D].
// Requires D % 32 == 0, D <= 256.

constexpr int EPL = D / 32;
static_assert(D % 32 == 0 && EPL <= 8, "D must be a multiple of 32, at most 256");
__shared__ float sm_m[16];
__shared__ float sm_l[16];
__shared__ float sm_o[16 * D];
const int lane = threadIdx.x & 31;
const int w = threadIdx.x >> 5;
const int W = blockDim.x >> 5;
const int hq = blockIdx.y;
const int b = blockIdx.z;
const int NB = ml_shape[2];
const int64_t row = ((int64_t)b * gridDim.y + hq) * NB;

float M = -INFINITY, den = 0.f, num[EPL];
#pragma unroll
for (int e = 0; e < EPL; ++e) num[e] = 0.f;
for (int j = w; j < NB; j += 2 * W) {
  const int j2 = min(j + W, NB - 1);  // the second block (a repeat of j weighs 0)
  const bool two = j + W < NB;
  const float m1 = ml[(row + j) * 2], l1 = ml[(row + j) * 2 + 1];
  const float m2 = two ? ml[(row + j2) * 2] : -INFINITY;
  const float l2 = ml[(row + j2) * 2 + 1];
  float o1[EPL], o2[EPL];
#pragma unroll
  for (int e = 0; e < EPL; ++e) {
    o1[e] = o_part[(row + j) * D + lane * EPL + e];
    o2[e] = o_part[(row + j2) * D + lane * EPL + e];
  }
  const float mn = fmaxf(M, fmaxf(m1, m2));
  if (mn == -INFINITY) {
    continue;  // no allowed key so far (warp-uniform)
  }
  const float c = exp2f(M - mn);  // 0 while M is -inf
  const float w1 = m1 == -INFINITY ? 0.f : exp2f(m1 - mn);
  const float w2 = m2 == -INFINITY ? 0.f : exp2f(m2 - mn);
  den = den * c + w1 * l1 + w2 * l2;
#pragma unroll
  for (int e = 0; e < EPL; ++e) num[e] = num[e] * c + w1 * o1[e] + w2 * o2[e];
  M = mn;
}
if (lane == 0) {
  sm_m[w] = M;
  sm_l[w] = den;
}
#pragma unroll
for (int e = 0; e < EPL; ++e) sm_o[w * D + lane * EPL + e] = num[e];
__syncthreads();
if (w == 0) {
  float Mt = -INFINITY;
  for (int i = 0; i < W; ++i) Mt = fmaxf(Mt, sm_m[i]);
  float dt = 0.f, nt[EPL];
#pragma unroll
  for (int e = 0; e < EPL; ++e) nt[e] = 0.f;
  for (int i = 0; i < W; ++i) {
    const float wi = sm_m[i] == -INFINITY ? 0.f : exp2f(sm_m[i] - Mt);
    dt += wi * sm_l[i];
#pragma unroll
    for (int e = 0; e < EPL; ++e) nt[e] += wi * sm_o[i * D + lane * EPL + e];
  }
#pragma unroll
  for (int e = 0; e < EPL; ++e) {
    const int d = lane * EPL + e;
    OutT y = static_cast<OutT>(nt[e] / dt);
    if (HAS_GATE) {
      y = qab_sigmoid_gate<OutT>(
          y, static_cast<float>(gate[(int64_t)b * gate_strides[0] + (int64_t)hq * gate_strides[2] +
                                     (int64_t)d * gate_strides[3]]));
    }
    out[((int64_t)b * gridDim.y + hq) * D + d] = y;
  }
}
