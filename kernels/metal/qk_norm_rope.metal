// Decode q/k preparation of Qwen3-Next / Qwen3.5 full attention in one
// launch; the contract of kernels/cuda/qk_norm_rope.cu (read that file's
// comment), rounded as mlx-lm's stock path on MLX's Metal backend
// (mx.fast.rms_norm, transpose, mx.fast.rope): y = InT(x * normalizer) with
// normalizer = metal::precise::rsqrt(sum(x^2) / D + eps), n = InT(w * y);
// then with theta_i = (scale * offset) * exp2(-(i / (R / 2)) * log2(base)),
// each rotated pair (n1, n2) -> (InT(n1 cos - n2 sin), InT(n1 sin + n2 cos))
// in float32 with metal::fast::cos / sin, as MLX's Metal rope; dims R.. keep
// n. Pairs are (i, i + R/2) ("rotate half") or, with TRAD, (2i, 2i + 1).
//
// One SIMD group per (b, head): lane i holds the EPL = D / 32 elements
// i * EPL .., the sum of squares reduced by simd_sum; a "rotate half" partner
// lives P = (R / 2) / EPL lanes away and comes by simd_shuffle, a traditional
// partner in the same lane. No threadgroup memory, no barrier.
// Never run where it was written: used only after its on-device self-check.
//
// Launch: grid (128 * HB, B, 1) threads, threadgroup (128, 1, 1), with
// HB = ceil((Hq + Hk) / 4) (a SIMD group per head, 4 per threadgroup).
// Inputs: q [B, 1, Hq, D], k [B, 1, Hk, D] (InT, any strides), q_weight,
// k_weight [D] InT, params [4] float32 (q eps, k eps, scale, log2(base)),
// offset int32 (0-d). Outputs: q_out [B, Hq, 1, D], k_out [B, Hk, 1, D] InT.
// Requires D % 32 == 0, D <= 256, R even, R <= D, and (R / 2) % EPL == 0
// (TRAD: EPL even).

constexpr int EPL = D / 32;
constexpr int HALF = R / 2;
static_assert(D % 32 == 0 && EPL <= 8, "D must be a multiple of 32, at most 256");
static_assert(R % 2 == 0 && R <= D, "R must be even, at most D");
static_assert(TRAD ? EPL % 2 == 0 : HALF % EPL == 0, "rotated pairs must map onto lanes");

const int lane = int(thread_index_in_simdgroup);
const int w = int(threadgroup_position_in_grid.x) * 4 + int(simdgroup_index_in_threadgroup);
const int b = int(threadgroup_position_in_grid.y);
const int Hq = q_shape[2];
const int Hk = k_shape[2];
if (w >= Hq + Hk) {
  return;  // a whole SIMD group: no shuffle is left waiting
}
const bool is_q = w < Hq;
const int h = is_q ? w : w - Hq;
const int64_t es = is_q ? q_strides[3] : k_strides[3];
const int64_t row = is_q ? int64_t(b) * q_strides[0] + int64_t(h) * q_strides[2]
                         : int64_t(b) * k_strides[0] + int64_t(h) * k_strides[2];
const float eps = params[is_q ? 0 : 1];
const float pos = params[2] * static_cast<float>(offset[0]);
const float log2_base = params[3];

float x[EPL];
float ss = 0.0f;
for (int e = 0; e < EPL; ++e) {
  const int64_t at = row + int64_t(lane * EPL + e) * es;
  x[e] = static_cast<float>(is_q ? q[at] : k[at]);
  ss += x[e] * x[e];
}
ss = simd_sum(ss);
const float normalizer = metal::precise::rsqrt(ss / float(D) + eps);
float n[EPL];
for (int e = 0; e < EPL; ++e) {
  const InT y = static_cast<InT>(x[e] * normalizer);
  const float wv = static_cast<float>(is_q ? q_weight[lane * EPL + e] : k_weight[lane * EPL + e]);
  n[e] = static_cast<float>(static_cast<InT>(wv * static_cast<float>(y)));
}
InT o[EPL];
for (int e = 0; e < EPL; ++e) {
  o[e] = static_cast<InT>(n[e]);
}
if (TRAD) {
  for (int e = 0; e + 1 < EPL; e += 2) {
    const int i = (lane * EPL + e) / 2;  // pair index
    if (2 * i < R) {
      const float theta =
          pos * metal::exp2(-(static_cast<float>(i) / static_cast<float>(HALF)) * log2_base);
      const float c = metal::fast::cos(theta);
      const float s = metal::fast::sin(theta);
      o[e] = static_cast<InT>(n[e] * c - n[e + 1] * s);
      o[e + 1] = static_cast<InT>(n[e] * s + n[e + 1] * c);
    }
  }
} else {
  const int P = HALF / EPL;  // lanes between a pair's halves
  const int partner = lane < P ? lane + P : (lane < 2 * P ? lane - P : lane);
  for (int e = 0; e < EPL; ++e) {
    // Every lane shuffles (lanes past the rotated dims read their own value).
    const float other = simd_shuffle(n[e], ushort(partner));
    const int d = lane * EPL + e;
    if (d < R) {
      const int i = d < HALF ? d : d - HALF;
      const float theta =
          pos * metal::exp2(-(static_cast<float>(i) / static_cast<float>(HALF)) * log2_base);
      const float c = metal::fast::cos(theta);
      const float s = metal::fast::sin(theta);
      o[e] = d < HALF ? static_cast<InT>(n[e] * c - other * s)
                      : static_cast<InT>(other * s + n[e] * c);
    }
  }
}
const int64_t out_row = is_q ? (int64_t(b) * Hq + h) * D : (int64_t(b) * Hk + h) * D;
for (int e = 0; e < EPL; ++e) {
  if (is_q) {
    q_out[out_row + lane * EPL + e] = o[e];
  } else {
    k_out[out_row + lane * EPL + e] = o[e];
  }
}
