// Routed experts' down projection for decode, weighted and summed over K.
//
// For token n and output row o:
//   y[n, o] = sum_k scores[n, k] * (h[n, k] . W[inds[n, k], o])
// W is [E, H, I] packed 8 nibbles per uint32 (MLX affine layout) with scales,
// biases [E, H, I / G]. One warp computes RPW output rows. The K * I / 32
// (slot, 32-value chunk) tasks of a row are spread over the lanes (16-byte
// weight loads; h read through L1, where every warp of the block shares it);
// each lane weights its partial dot products by the slot's score, and one
// warp reduction per row finishes the sum over K.
//
// Launch: grid (32 * H / RPW, N, 1) threads, threadgroup (256, 1, 1).
// Requires I % 32 == 0, H % RPW == 0, G % 32 == 0.
// Template: OutT (y), H, I, K, G (group size), ST (scores' dtype: float,
// bfloat16 or float16, read as float; the router's own dtype, so no cast op).
// Inputs: h [N, K, I]; inds [N, K] uint32; scores [N, K] ST; w [E, H,
// I/8] uint32; scales, biases [E, H, I/G]. Output: y [N, H] OutT (any
// leading axes with N rows: the caller's [B, T, H]). Row-contiguous inputs.

constexpr int RPW = 2;              // output rows per warp
constexpr int CPR = I / 32;         // 32-value chunks per weight row
constexpr int WPR = I / 8;          // uint32 words per weight row
constexpr int GPR = I / G;          // quantization groups per row
const int lane = threadIdx.x & 31;
const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
const int n = blockIdx.y;
if (warp * RPW >= H) {
  return;
}
#pragma unroll
for (int p = 0; p < RPW; ++p) {
  const int o = warp * RPW + p;
  float acc = 0.f;
  for (int task = lane; task < K * CPR; task += 32) {
    const int k = task / CPR;
    const int c = task - k * CPR;
    const uint32_t e = inds[(size_t)n * K + k];
    const size_t row = (size_t)e * H + o;
    const uint4 pk = reinterpret_cast<const uint4*>(w + row * WPR)[c];
    const uint32_t words[4] = {pk.x, pk.y, pk.z, pk.w};
    const size_t hb = ((size_t)n * K + k) * I + c * 32;
    float d = 0.f, hs = 0.f;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
#pragma unroll
      for (int b = 0; b < 8; ++b) {
        const float hv = static_cast<float>(h[hb + q * 8 + b]);
        d += qab_nibble(words[q], b) * hv;
        hs += hv;
      }
    }
    const size_t gi = row * GPR + (c * 32) / G;
    acc += static_cast<float>(scores[(size_t)n * K + k]) *
        (static_cast<float>(scales[gi]) * d + static_cast<float>(biases[gi]) * hs);
  }
  acc = qab_warp_sum(acc);
  if (lane == 0) {
    y[(size_t)n * H + o] = static_cast<OutT>(acc);
  }
}
