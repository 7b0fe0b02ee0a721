// Decode, 4-bit affine: the K routed experts' down projections weighted by the
// routing scores plus the shared expert's (slot K of h) weighted by
// sigmoid(sg_logit); same contract as kernels/cuda/moe_down_shared_gemv.cu
// (read that file's comment). Never run where it was written: used only after
// its on-device self-check passes.
//
// Launch: grid (32 * H / RPW, N, 1) threads, threadgroup (256, 1, 1).
// Template adds ST, the scores' dtype (read as float), and HAS_RES: the
// residual res [N, H] OutT added in the epilogue as the stock layer adds it.

constexpr int RPW = 2;
constexpr int CPR = I / 32;
constexpr int WPR = I / 8;
constexpr int GPR = I / G;
constexpr int KS = K + 1;
const uint lane = thread_index_in_simdgroup;
const uint warp = thread_position_in_grid.x / 32;
const uint n = thread_position_in_grid.y;
if (warp * RPW >= uint(H)) {
  return;
}
const float shared_weight = 1.0f / (1.0f + metal::exp(-sg_logit[n]));
for (int p = 0; p < RPW; ++p) {
  const uint o = warp * RPW + p;
  float acc = 0.0f;
  for (uint task = lane; task < uint(KS * CPR); task += 32) {
    const uint k = task / CPR;
    const uint c = task - k * CPR;
    const bool is_shared = k == uint(K);
    // Slot K reads the shared expert's own arrays; inds and scores have no column K.
    const size_t row = is_shared ? size_t(o) : size_t(inds[size_t(n) * K + k]) * H + o;
    const device uint* wrow = is_shared ? s_down_w + row * WPR : w + row * WPR;
    auto srow = is_shared ? s_down_scales + row * GPR : scales + row * GPR;
    auto brow = is_shared ? s_down_biases + row * GPR : biases + row * GPR;
    const float weight = is_shared ? shared_weight : static_cast<float>(scores[size_t(n) * K + k]);
    const uint4 pk = ((const device uint4*)wrow)[c];
    const size_t hb = (size_t(n) * KS + k) * I + c * 32;
    float d = 0.0f, hs = 0.0f;
    for (int q = 0; q < 4; ++q) {
      const uint word = pk[q];
      for (int b = 0; b < 8; ++b) {
        const float hv = static_cast<float>(h[hb + q * 8 + b]);
        d += float((word >> (4 * b)) & 15u) * hv;
        hs += hv;
      }
    }
    const uint gi = (c * 32) / G;
    acc += weight * (static_cast<float>(srow[gi]) * d + static_cast<float>(brow[gi]) * hs);
  }
  acc = simd_sum(acc);
  if (lane == 0) {
    const size_t i = size_t(n) * H + o;
    if (HAS_RES) {
      y[i] = static_cast<OutT>(static_cast<float>(res[i]) +
                               static_cast<float>(static_cast<OutT>(acc)));
    } else {
      y[i] = static_cast<OutT>(acc);
    }
  }
}
