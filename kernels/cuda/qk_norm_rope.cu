// Decode q/k preparation of Qwen3-Next / Qwen3.5 full attention in one
// launch: per head, RMSNorm with its weight, then RoPE over the first R dims
// at the token's position, for the Hq query heads and the Hk key heads of
// one token. Rounded as mlx-lm's stock path (mx.fast.rms_norm, transpose,
// mx.fast.rope on MLX's CUDA backend): y = InT(x * rsqrt(mean(x^2) + eps)),
// n = InT(w * y); then with theta_i = scale * offset * exp2(-(i / (R / 2)) *
// log2(base)), each rotated pair (n1, n2) -> (InT(n1 cos - n2 sin),
// InT(n1 sin + n2 cos)) in float32; dims R.. keep n. Pairs are (i, i + R/2)
// ("rotate half") or, with TRAD, (2i, 2i + 1).
//
// One warp per (b, head): lane i holds the EPL = D / 32 elements i * EPL ..,
// the sum of squares reduced by butterflies; a "rotate half" partner lives
// P = (R / 2) / EPL lanes away and comes by shuffle, a traditional partner in
// the same lane.
//
// Launch: grid (32 * 4 * ceil((Hq + Hk) / 4), B) threads, threadgroup
// (128, 1, 1). Inputs: q [B, 1, Hq, D], k [B, 1, Hk, D] (InT, any strides),
// q_weight, k_weight [D] InT, params [4] float32 (q eps, k eps, scale,
// log2(base)), offset int32 (0-d). Outputs: q_out [B, Hq, 1, D], k_out
// [B, Hk, 1, D] InT. Requires D % 32 == 0, D <= 256, R even, R <= D, and
// (R / 2) % EPL == 0 (TRAD: EPL even).

constexpr int EPL = D / 32;
constexpr int HALF = R / 2;
static_assert(D % 32 == 0 && EPL <= 8, "D must be a multiple of 32, at most 256");
static_assert(R % 2 == 0 && R <= D, "R must be even, at most D");
static_assert(TRAD ? EPL % 2 == 0 : HALF % EPL == 0, "rotated pairs must map onto lanes");
const int lane = threadIdx.x & 31;
const int w = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
const int b = blockIdx.y;
const int Hq = q_shape[2], Hk = k_shape[2];
if (w >= Hq + Hk) {
  return;
}
const bool is_q = w < Hq;
const int h = is_q ? w : w - Hq;
const InT* src = is_q ? q + (int64_t)b * q_strides[0] + (int64_t)h * q_strides[2]
                      : k + (int64_t)b * k_strides[0] + (int64_t)h * k_strides[2];
const int64_t es = is_q ? q_strides[3] : k_strides[3];
const InT* wt = is_q ? q_weight : k_weight;
const float eps = params[is_q ? 0 : 1];

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

const float pos = params[2] * static_cast<float>(offset[0]);
const float log2_base = params[3];
InT o[EPL];
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
InT* dst = is_q ? q_out + ((int64_t)b * Hq + h) * D : k_out + ((int64_t)b * Hk + h) * D;
#pragma unroll
for (int e = 0; e < EPL; ++e) dst[lane * EPL + e] = o[e];
