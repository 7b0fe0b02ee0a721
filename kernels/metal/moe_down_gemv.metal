// Routed experts' down projection for decode, weighted and summed over K;
// same contract as kernels/cuda/moe_down_gemv.cu (read that file's comment).
// Never run where it was written: used only after its on-device self-check
// passes.
//
// Launch: grid (32 * H / RPW, N, 1) threads, threadgroup (256, 1, 1).
// Template adds ST, the scores' dtype (read as float).

constexpr int RPW = 2;
constexpr int CPR = I / 32;
constexpr int WPR = I / 8;
constexpr int GPR = I / G;
const uint lane = thread_index_in_simdgroup;
const uint warp = thread_position_in_grid.x / 32;
const uint n = thread_position_in_grid.y;
if (warp * RPW >= uint(H)) {
  return;
}
for (int p = 0; p < RPW; ++p) {
  const uint o = warp * RPW + p;
  float acc = 0.0f;
  for (uint task = lane; task < uint(K * CPR); task += 32) {
    const uint k = task / CPR;
    const uint c = task - k * CPR;
    const uint e = inds[size_t(n) * K + k];
    const size_t row = size_t(e) * H + o;
    const uint4 pk = ((const device uint4*)(w + row * WPR))[c];
    const size_t hb = (size_t(n) * K + k) * I + c * 32;
    float d = 0.0f, hs = 0.0f;
    for (int q = 0; q < 4; ++q) {
      const uint word = pk[q];
      for (int b = 0; b < 8; ++b) {
        const float hv = static_cast<float>(h[hb + q * 8 + b]);
        d += float((word >> (4 * b)) & 15u) * hv;
        hs += hv;
      }
    }
    const size_t gi = row * GPR + (c * 32) / G;
    acc += static_cast<float>(scores[size_t(n) * K + k]) *
        (static_cast<float>(scales[gi]) * d + static_cast<float>(biases[gi]) * hs);
  }
  acc = simd_sum(acc);
  if (lane == 0) {
    y[size_t(n) * H + o] = static_cast<OutT>(acc);
  }
}
