// Decode (a few tokens), 4-bit affine: the K routed experts' gate+up rows AND
// the shared expert's, as K + 1 slots, plus the shared expert's gate logit.
//
// For token n, slot k < K with expert e = inds[n, k], and r < I:
//   h[n, k, r] = silu(x[n] . W[e, r]) * (x[n] . W[e, I + r])
// slot K is the shared expert (its own gate_proj / up_proj arrays, [I, H]):
//   h[n, K, r] = silu(x[n] . s_gate[r]) * (x[n] . s_up[r])
// and one more warp per token computes the shared expert gate's logit
//   sg_logit[n] = x[n] . sg_w[0]          (float32, no sigmoid here)
// from its SGB-bit (4 or 8) affine row with groups of SGG inputs.
// W is the fused [E, 2I, H] gate+up weight packed 8 nibbles per uint32 (MLX's
// affine layout: value j of a word at bits 4j), with one scale and bias per G
// consecutive inputs; the shared expert's gate_proj / up_proj use the same
// packing and G (8-bit rows: 4 values per word, value j at bits 8j).
// Dequantized dot: sum_j (s q_j + b) x_j = s * sum_j q_j x_j + b * sum_j x_j.
// As in moe_gate_up_gemv.cu: one warp computes RPW (gate, up) row pairs; each
// lane owns the 32-value chunks c = lane + 32 i of a row (16-byte loads,
// coalesced across the warp). A warp issues every weight, scale and bias load
// of its RPW row pairs before any arithmetic (loads in flight are what a GEMV
// at batch 1 lives on); x is staged once per block in shared memory as float,
// chunk-transposed (xs[j / 4][c] holds x[32 c + j .. + 3]: lanes reading
// consecutive chunks hit consecutive 16-byte words), with each chunk's sum.
// The shared slot's scales and biases must have the routed ones' dtype (one
// pointer type for both).
//
// Launch: grid (32 * NW, N, 1) threads, threadgroup (256, 1, 1), with NW =
// (K + 1) * I / RPW + 1 warps rounded up to a multiple of 8; spare warps exit.
// Requires H % 1024 == 0, I % RPW == 0, G % 32 == 0, SGG % 32 == 0, and
// H * 4 + H / 8 bytes of shared memory (8.25 KB at H = 2,048).
// Inputs: x [N, H]; inds [N, K] uint32; w [E, 2I, H/8] uint32; scales, biases
// [E, 2I, H/G]; s_gate_w, s_up_w [I, H/8] uint32; s_gate_scales,
// s_gate_biases, s_up_scales, s_up_biases [I, H/G]; sg_w [1, H*SGB/32]
// uint32; sg_scales, sg_biases [1, H/SGG].
// Outputs: h [N, K+1, I] OutT; sg_logit [max(N, 4)] float32 (element n per
// token row; at least 16 bytes, see ops.device.unpooled_length; the elements
// past N are written 0 and never read).

constexpr int RPW = 2;              // row pairs per warp
constexpr int NC = H / 32;          // 32-value chunks per row
constexpr int CPL = H / 1024;       // 32-value chunks per lane
constexpr int WPR = H / 8;          // uint32 words per 4-bit weight row
constexpr int GPR = H / G;          // quantization groups per row
constexpr int KS = K + 1;           // slots: K routed experts, then the shared one
constexpr int NRW = KS * I / RPW;   // warps of row pairs; warp NRW: the gate logit
__shared__ float4 xs[8][NC];
__shared__ float xsum[NC];
const int tid = threadIdx.x;
const int lane = tid & 31;
const int warp = (blockIdx.x * blockDim.x + tid) >> 5;
const int n = blockIdx.y;

// x of token n, staged once per block, and each chunk's sum (shared by every row).
for (int e = tid; e < NC * 8; e += blockDim.x) {
  const int c = e >> 3;
  const int j4 = e & 7;
  const size_t b = (size_t)n * H + c * 32 + j4 * 4;
  xs[j4][c] = make_float4(static_cast<float>(x[b]), static_cast<float>(x[b + 1]),
                          static_cast<float>(x[b + 2]), static_cast<float>(x[b + 3]));
}
__syncthreads();
for (int c = tid; c < NC; c += blockDim.x) {
  float s = 0.f;
#pragma unroll
  for (int j4 = 0; j4 < 8; ++j4) {
    const float4 v = xs[j4][c];
    s += v.x;
    s += v.y;
    s += v.z;
    s += v.w;
  }
  xsum[c] = s;
}
__syncthreads();
if (warp > NRW) {
  return;
}

if (warp == NRW) {
  // The shared expert gate's single row: a 32-value chunk is SGB words.
  constexpr int VPW = 32 / SGB;     // values per word
  constexpr unsigned MASK = (1u << SGB) - 1u;
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < CPL; ++i) {
    const int c = lane + 32 * i;
    float xv[32];
#pragma unroll
    for (int j4 = 0; j4 < 8; ++j4) {
      const float4 v = xs[j4][c];
      xv[4 * j4] = v.x;
      xv[4 * j4 + 1] = v.y;
      xv[4 * j4 + 2] = v.z;
      xv[4 * j4 + 3] = v.w;
    }
    const uint4* src = reinterpret_cast<const uint4*>(sg_w + (size_t)c * SGB);
    float d = 0.f;
#pragma unroll
    for (int v = 0; v < SGB / 4; ++v) {
      const uint4 pk = src[v];
      const uint32_t words[4] = {pk.x, pk.y, pk.z, pk.w};
#pragma unroll
      for (int q = 0; q < 4; ++q) {
#pragma unroll
        for (int b = 0; b < VPW; ++b) {
          d += static_cast<float>((words[q] >> (SGB * b)) & MASK) * xv[(v * 4 + q) * VPW + b];
        }
      }
    }
    const int gi = (c * 32) / SGG;
    acc += static_cast<float>(sg_scales[gi]) * d + static_cast<float>(sg_biases[gi]) * xsum[c];
  }
  acc = qab_warp_sum(acc);
  if (lane == 0) {
    sg_logit[n] = acc;
  } else if (n == 0 && lane < 4 && lane >= static_cast<int>(gridDim.y)) {
    sg_logit[lane] = 0.f;  // the 16-byte buffer's elements past N rows (never read)
  }
  return;
}

// Every weight, scale and bias load of this warp's row pairs, before any arithmetic.
uint4 wv[RPW][2][CPL];
float sc[RPW][2][CPL];
float bi[RPW][2][CPL];
#pragma unroll
for (int p = 0; p < RPW; ++p) {
  const int kr = warp * RPW + p;
  const int k = kr / I;
  const int r = kr - k * I;
  const bool is_shared = k == K;
  // Slot K reads the shared expert's own arrays; inds has no column K.
  const size_t e = is_shared ? 0 : static_cast<size_t>(inds[(size_t)n * K + k]);
  const size_t gate_row = e * 2 * I + r;
  const size_t up_row = gate_row + I;
  const uint32_t* wg = is_shared ? s_gate_w + (size_t)r * WPR : w + gate_row * WPR;
  const uint32_t* wu = is_shared ? s_up_w + (size_t)r * WPR : w + up_row * WPR;
  auto sgp = is_shared ? s_gate_scales + (size_t)r * GPR : scales + gate_row * GPR;
  auto bgp = is_shared ? s_gate_biases + (size_t)r * GPR : biases + gate_row * GPR;
  auto sup = is_shared ? s_up_scales + (size_t)r * GPR : scales + up_row * GPR;
  auto bup = is_shared ? s_up_biases + (size_t)r * GPR : biases + up_row * GPR;
#pragma unroll
  for (int t = 0; t < 2; ++t) {
    const uint4* wrow = reinterpret_cast<const uint4*>(t ? wu : wg);
    auto srow = t ? sup : sgp;
    auto brow = t ? bup : bgp;
#pragma unroll
    for (int i = 0; i < CPL; ++i) {
      const int c = lane + 32 * i;
      wv[p][t][i] = wrow[c];
      sc[p][t][i] = static_cast<float>(srow[(c * 32) / G]);
      bi[p][t][i] = static_cast<float>(brow[(c * 32) / G]);
    }
  }
}

float acc[RPW][2];
#pragma unroll
for (int p = 0; p < RPW; ++p) {
  acc[p][0] = 0.f;
  acc[p][1] = 0.f;
}
#pragma unroll
for (int i = 0; i < CPL; ++i) {
  const int c = lane + 32 * i;
  float xv[32];
#pragma unroll
  for (int j4 = 0; j4 < 8; ++j4) {
    const float4 v = xs[j4][c];
    xv[4 * j4] = v.x;
    xv[4 * j4 + 1] = v.y;
    xv[4 * j4 + 2] = v.z;
    xv[4 * j4 + 3] = v.w;
  }
  const float xs_sum = xsum[c];
#pragma unroll
  for (int p = 0; p < RPW; ++p) {
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const uint32_t words[4] = {wv[p][t][i].x, wv[p][t][i].y, wv[p][t][i].z, wv[p][t][i].w};
      float d = 0.f;
#pragma unroll
      for (int q = 0; q < 4; ++q) {
#pragma unroll
        for (int b = 0; b < 8; ++b) {
          d += static_cast<float>((words[q] >> (4 * b)) & 15u) * xv[q * 8 + b];
        }
      }
      acc[p][t] += sc[p][t][i] * d + bi[p][t][i] * xs_sum;
    }
  }
}

#pragma unroll
for (int p = 0; p < RPW; ++p) {
  const int kr = warp * RPW + p;
  const int k = kr / I;
  const int r = kr - k * I;
  const float gate = qab_warp_sum(acc[p][0]);
  const float up = qab_warp_sum(acc[p][1]);
  if (lane == 0) {
    const float silu = gate / (1.f + expf(-gate));
    h[((size_t)n * KS + k) * I + r] = static_cast<OutT>(silu * up);
  }
}
