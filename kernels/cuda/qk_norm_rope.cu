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
// Launch: grid (128 * HB, B, 1) threads, threadgroup (128, 1, 1), with
// HB = ceil((Hq + Hk) / 4) (a warp per head, 4 per block). Inputs: q
// [B, 1, Hq, D], k [B, 1, Hk, D] (InT, any strides), q_weight, k_weight [D]
// InT, params [4] float32 (q eps, k eps, scale, log2(base)), offset int32
// (0-d). Outputs: q_out [B, Hq, 1, D], k_out [B, Hk, 1, D] InT. Requires
// D % 32 == 0, D <= 256, R even, R <= D, and (R / 2) % EPL == 0 (TRAD: EPL
// even).

// The row arithmetic is qk_norm_rope.cuh's (shared with gqa_decode_step.cu).
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
InT o[D / 32];
qab_qk_norm_rope_row<InT, D, R, TRAD>(src, es, is_q ? q_weight : k_weight,
                                      params[is_q ? 0 : 1],
                                      params[2] * static_cast<float>(offset[0]), params[3],
                                      lane, o);
InT* dst = is_q ? q_out + ((int64_t)b * Hq + h) * D : k_out + ((int64_t)b * Hk + h) * D;
#pragma unroll
for (int e = 0; e < D / 32; ++e) dst[lane * (D / 32) + e] = o[e];
