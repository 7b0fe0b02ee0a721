// The rows of the MoE decode fold's down kernel, shared by
// moe_down_shared_gemv.cu and moe_down_shared_norm_gemv.cu: warp `warp` computes
// output rows [QAB_DOWN_RPW warp, QAB_DOWN_RPW warp + QAB_DOWN_RPW) of token n,
// the K routed experts' 4-bit down projections weighted by the routing scores
// plus the shared expert's weighted by sigmoid(sg_logit[n]), summed; with
// HAS_RES plus the residual as the stock layer adds it. The arithmetic is
// described in moe_down_shared_gemv.cu. Every lane of the warp must call it;
// the caller guarantees QAB_DOWN_RPW * warp < H.

constexpr int QAB_DOWN_RPW = 2;  // output rows per warp

template <typename OutT, int H, int I, int K, int G, bool HAS_RES, typename HT, typename ST,
          typename QT, typename SQT, typename RT>
__device__ __forceinline__ void qab_moe_down_shared_rows(
    const int warp, const int lane, const int n, const HT* h, const uint32_t* inds,
    const ST* scores, const uint32_t* w, const QT* scales, const QT* biases,
    const uint32_t* s_down_w, const SQT* s_down_scales, const SQT* s_down_biases,
    const float* sg_logit, const RT* res, OutT* y) {
  constexpr int RPW = QAB_DOWN_RPW;
  constexpr int CPR = I / 32;         // 32-value chunks per weight row
  constexpr int WPR = I / 8;          // uint32 words per weight row
  constexpr int GPR = I / G;          // quantization groups per row
  constexpr int KS = K + 1;           // slots: K routed experts, then the shared one
  const float shared_weight = 1.f / (1.f + expf(-sg_logit[n]));
#pragma unroll
  for (int p = 0; p < RPW; ++p) {
    const int o = warp * RPW + p;
    float acc = 0.f;
    for (int task = lane; task < KS * CPR; task += 32) {
      const int k = task / CPR;
      const int c = task - k * CPR;
      const bool is_shared = k == K;
      // Slot K reads the shared expert's own arrays; inds and scores have no column K.
      const size_t row = is_shared ? (size_t)o
                                   : static_cast<size_t>(inds[(size_t)n * K + k]) * H + o;
      const uint32_t* wrow = is_shared ? s_down_w + row * WPR : w + row * WPR;
      const float sv = is_shared ? static_cast<float>(s_down_scales[row * GPR + (c * 32) / G])
                                 : static_cast<float>(scales[row * GPR + (c * 32) / G]);
      const float bv = is_shared ? static_cast<float>(s_down_biases[row * GPR + (c * 32) / G])
                                 : static_cast<float>(biases[row * GPR + (c * 32) / G]);
      const float weight =
          is_shared ? shared_weight : static_cast<float>(scores[(size_t)n * K + k]);
      const uint4 pk = reinterpret_cast<const uint4*>(wrow)[c];
      const uint32_t words[4] = {pk.x, pk.y, pk.z, pk.w};
      const size_t hb = ((size_t)n * KS + k) * I + c * 32;
      float d = 0.f, hs = 0.f;
#pragma unroll
      for (int q = 0; q < 4; ++q) {
#pragma unroll
        for (int b = 0; b < 8; ++b) {
          const float hv = static_cast<float>(h[hb + q * 8 + b]);
          d += static_cast<float>((words[q] >> (4 * b)) & 15u) * hv;
          hs += hv;
        }
      }
      acc += weight * (sv * d + bv * hs);
    }
    acc = qab_warp_sum(acc);
    if (lane == 0) {
      const size_t i = (size_t)n * H + o;
      if (HAS_RES) {
        y[i] = static_cast<OutT>(static_cast<float>(res[i]) +
                                 static_cast<float>(static_cast<OutT>(acc)));
      } else {
        y[i] = static_cast<OutT>(acc);
      }
    }
  }
}
