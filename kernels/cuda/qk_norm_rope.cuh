// One head row's RMSNorm + RoPE, held by one warp (qk_norm_rope.cu and
// gqa_decode_step.cu): lane i holds the EPL = D / 32 elements i * EPL .. of
// the row. Rounded as mlx-lm's stock path on MLX's CUDA backend
// (mx.fast.rms_norm, then mx.fast.rope): y = InT(x * rsqrt(mean(x^2) + eps)),
// n = InT(w * y); then with theta_i = pos * exp2(-(i / (R / 2)) * log2_base)
// (pos = RoPE scale * position), each rotated pair (n1, n2) ->
// (InT(n1 cos - n2 sin), InT(n1 sin + n2 cos)) in float32; dims R.. keep n.
// Pairs are (i, i + R/2) ("rotate half": the partner lives P = (R / 2) / EPL
// lanes away and comes by shuffle) or, with TRAD, (2i, 2i + 1) (same lane).
// The whole warp must be converged. src: the row's element 0, es: its element
// stride; wt: the [D] norm weight.
template <typename InT, int D, int R, bool TRAD>
__device__ __forceinline__ void qab_qk_norm_rope_row(const InT* src, const int64_t es,
                                                     const InT* wt, const float eps,
                                                     const float pos, const float log2_base,
                                                     const int lane, InT (&o)[D / 32]) {
  constexpr int EPL = D / 32;
  constexpr int HALF = R / 2;
  static_assert(D % 32 == 0 && EPL <= 8, "D must be a multiple of 32, at most 256");
  static_assert(R % 2 == 0 && R <= D, "R must be even, at most D");
  static_assert(TRAD ? EPL % 2 == 0 : HALF % EPL == 0, "rotated pairs must map onto lanes");
  float x[EPL];
  float ss = 0.f;
#pragma unroll
  for (int e = 0; e < EPL; ++e) {
    x[e] = static_cast<float>(src[(int64_t)(lane * EPL + e) * es]);
    ss += x[e] * x[e];
  }
  ss = qab_warp_sum(ss);
  const float normalizer = rsqrtf(ss / D + eps);
  float n[EPL];
#pragma unroll
  for (int e = 0; e < EPL; ++e) {
    const InT y = static_cast<InT>(x[e] * normalizer);
    n[e] = static_cast<float>(static_cast<InT>(static_cast<float>(wt[lane * EPL + e]) *
                                               static_cast<float>(y)));
  }
#pragma unroll
  for (int e = 0; e < EPL; ++e) o[e] = static_cast<InT>(n[e]);
  if (TRAD) {
#pragma unroll
    for (int e = 0; e < EPL; e += 2) {
      const int i = (lane * EPL + e) / 2;  // pair index
      if (2 * i < R) {
        const float theta = pos * exp2f(-(static_cast<float>(i) / static_cast<float>(HALF)) *
                                        log2_base);
        const float c = cosf(theta), s = sinf(theta);
        o[e] = static_cast<InT>(n[e] * c - n[e + 1] * s);
        o[e + 1] = static_cast<InT>(n[e] * s + n[e + 1] * c);
      }
    }
  } else {
    constexpr int P = HALF / EPL;  // lanes between a pair's halves
    const int partner = lane < P ? lane + P : (lane < 2 * P ? lane - P : lane);
#pragma unroll
    for (int e = 0; e < EPL; ++e) {
      const float other = __shfl_sync(0xffffffffu, n[e], partner);
      const int d = lane * EPL + e;
      if (d < R) {
        const int i = d < HALF ? d : d - HALF;
        const float theta = pos * exp2f(-(static_cast<float>(i) / static_cast<float>(HALF)) *
                                        log2_base);
        const float c = cosf(theta), s = sinf(theta);
        o[e] = d < HALF ? static_cast<InT>(n[e] * c - other * s)
                        : static_cast<InT>(other * s + n[e] * c);
      }
    }
  }
}
