// Decode, 4-bit affine: the K routed experts' down projections weighted by the
// routing scores, plus the shared expert's down projection weighted by
// sigmoid(sg_logit), summed; the second kernel of moe_gate_up_shared_gemv.cu.
//
// For token n and output row o:
//   y[n, o] = sum_k scores[n, k] * (h[n, k] . W[inds[n, k], o])
//           + sigmoid(sg_logit[n]) * (h[n, K] . s_down[o])
// W is [E, H, I] packed 8 nibbles per uint32 (MLX affine layout) with scales,
// biases [E, H, I / G]; s_down is the shared expert's [H, I] down_proj with
// the same packing and G, its scales and biases of the routed ones' dtype.
// As in moe_down_gemv.cu: one warp computes RPW output rows; the (K + 1) * I /
// 32 (slot, 32-value chunk) tasks of a row are spread over the lanes (16-byte
// weight loads; h read through L1, where every warp of the block shares it);
// each lane weights its partial dot products by the slot's weight, and one
// warp reduction per row finishes the sum. Float32 throughout; y rounded once.
// With HAS_RES the decoder layer's residual is added in the epilogue, as the
// stock layer adds it (`h + mlp(...)`: the block output rounded to OutT, then
// the sum rounded), which saves the model one Add launch per layer and token.
//
// Launch: grid (32 * H / RPW, N, 1) threads, threadgroup (256, 1, 1).
// Requires I % 32 == 0, H % RPW == 0, G % 32 == 0.
// Template: OutT (y), H, I, K, G (group size), ST (scores' dtype: float,
// bfloat16 or float16, read as float; the router's own dtype, so no cast op),
// HAS_RES (bool: add res).
// Inputs: h [N, K+1, I]; inds [N, K] uint32; scores [N, K] ST; w [E, H,
// I/8] uint32; scales, biases [E, H, I/G]; s_down_w [H, I/8] uint32;
// s_down_scales, s_down_biases [H, I/G]; sg_logit [N] float32; res [N, H]
// OutT (the residual; without HAS_RES any OutT array, not read).
// Output: y [N, H] OutT (any leading axes with N rows: the caller's [B, T, H]).

constexpr int RPW = 2;              // output rows per warp
constexpr int CPR = I / 32;         // 32-value chunks per weight row
constexpr int WPR = I / 8;          // uint32 words per weight row
constexpr int GPR = I / G;          // quantization groups per row
constexpr int KS = K + 1;           // slots: K routed experts, then the shared one
const int lane = threadIdx.x & 31;
const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
const int n = blockIdx.y;
if (warp * RPW >= H) {
  return;
}
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
    auto srow = is_shared ? s_down_scales + row * GPR : scales + row * GPR;
    auto brow = is_shared ? s_down_biases + row * GPR : biases + row * GPR;
    const float weight = is_shared ? shared_weight : static_cast<float>(scores[(size_t)n * K + k]);
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
    const int gi = (c * 32) / G;
    acc += weight * (static_cast<float>(srow[gi]) * d + static_cast<float>(brow[gi]) * hs);
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
