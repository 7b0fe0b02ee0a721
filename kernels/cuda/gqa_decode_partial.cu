// Split-K decode attention, first pass (flash-decoding): one query token
// against one block of BLOCK cached keys, for the G = Hq / Hk query heads that
// share a KV head, so each K and V row is read once for all G heads (GQA
// packing). Per (b, KV head h, key block j), with q_g the g-th query head of h
// and s over the block's keys that the mask allows:
//   m_g = max_s score(g, s),  l_g = sum_s exp(score - m_g),
//   o_g = sum_s exp(score - m_g) v_s,   score(g, s) = q_g . k_s * scale
// written unnormalised in float32 (scores in log2 units: exp2 of
// score * log2(e)); gqa_decode_combine.cu merges the blocks. A block with no
// allowed key writes m = -inf, l = 0, o = 0.
//
// One warp per (b, h, j); lane i holds the D / 32 elements i * D / 32 ..
// of each row (q of the G heads in registers). Each key: the warp reads the
// K row (coalesced), reduces G dot products by butterflies, updates the
// online softmax, reads the V row and accumulates. q, K and V are read
// through their strides (the KV cache's views are not contiguous over heads).
//
// Launch: grid (32 * NB, Hk, B) threads, threadgroup (32, 1, 1), NB =
// ceil(S / BLOCK). Inputs: q [B, Hq, 1, D], k, v [B, Hk, S, D] (InT, any
// strides), mask [B, S] bool (read only if HAS_MASK), scale [1]
// float32. Outputs: o_part [B, Hq, NB, D], ml [B, Hq, NB, 2] float32.
// Requires D % 32 == 0 and D <= 256.

constexpr int EPL = D / 32;
static_assert(D % 32 == 0 && EPL <= 8, "D must be a multiple of 32, at most 256");
const int lane = threadIdx.x;
const int j = blockIdx.x;
const int h = blockIdx.y;
const int b = blockIdx.z;
const int S = k_shape[2];
const int NB = (S + BLOCK - 1) / BLOCK;
const int s0 = j * BLOCK;
const int s1 = min(s0 + BLOCK, S);
const float qscale = scale[0] * 1.4426950408889634f;  // log2(e)

float qf[G][EPL];
#pragma unroll
for (int g = 0; g < G; ++g) {
  const size_t qb = (size_t)b * q_strides[0] + (size_t)(h * G + g) * q_strides[1];
#pragma unroll
  for (int e = 0; e < EPL; ++e) {
    qf[g][e] = static_cast<float>(q[qb + (size_t)(lane * EPL + e) * q_strides[3]]) * qscale;
  }
}
float m[G], l[G], o[G][EPL];
#pragma unroll
for (int g = 0; g < G; ++g) {
  m[g] = -INFINITY;
  l[g] = 0.f;
#pragma unroll
  for (int e = 0; e < EPL; ++e) o[g][e] = 0.f;
}
const size_t kb = (size_t)b * k_strides[0] + (size_t)h * k_strides[1] +
                  (size_t)lane * EPL * k_strides[3];
const size_t vb = (size_t)b * v_strides[0] + (size_t)h * v_strides[1] +
                  (size_t)lane * EPL * v_strides[3];
for (int s = s0; s < s1; ++s) {
  if (HAS_MASK && !mask[(size_t)b * S + s]) {
    continue;  // the same s for the whole warp: no divergence
  }
  float kf[EPL], vf[EPL];
#pragma unroll
  for (int e = 0; e < EPL; ++e) {
    kf[e] = static_cast<float>(k[kb + (size_t)s * k_strides[2] + (size_t)e * k_strides[3]]);
    vf[e] = static_cast<float>(v[vb + (size_t)s * v_strides[2] + (size_t)e * v_strides[3]]);
  }
#pragma unroll
  for (int g = 0; g < G; ++g) {
    float d = 0.f;
#pragma unroll
    for (int e = 0; e < EPL; ++e) d += qf[g][e] * kf[e];
#pragma unroll
    for (int w = 16; w > 0; w >>= 1) d += __shfl_xor_sync(0xffffffffu, d, w);
    const float mn = fmaxf(m[g], d);
    const float corr = exp2f(m[g] - mn);
    const float p = exp2f(d - mn);
    m[g] = mn;
    l[g] = l[g] * corr + p;
#pragma unroll
    for (int e = 0; e < EPL; ++e) o[g][e] = o[g][e] * corr + p * vf[e];
  }
}
#pragma unroll
for (int g = 0; g < G; ++g) {
  const size_t row = ((size_t)b * (gridDim.y * G) + h * G + g) * NB + j;
#pragma unroll
  for (int e = 0; e < EPL; ++e) o_part[row * D + lane * EPL + e] = o[g][e];
  if (lane == 0) {
    ml[row * 2] = m[g];
    ml[row * 2 + 1] = l[g];
  }
}
