// Routed experts' gate+up projection for decode (a few tokens), 4-bit affine.
//
// For token n and slot k with expert e = inds[n, k], and r < I:
//   gate = x[n] . W[e, r],  up = x[n] . W[e, I + r]
//   h[n, k, r] = silu(gate) * up
// W is the fused [E, 2I, H] gate+up weight packed 8 nibbles per uint32 (MLX's
// affine layout: value j of a word at bits 4j), with one scale and bias per G
// consecutive inputs (scales, biases [E, 2I, H / G]). Dequantized dot:
//   sum_j (s q_j + b) x_j = s * sum_j q_j x_j + b * sum_j x_j.
// One warp computes RPW (gate, up) row pairs. Each lane owns the 32-value
// chunks c = lane + 32 i of the row (16-byte loads, coalesced across the
// warp) and keeps the matching x values in registers for all its rows.
//
// Launch: grid (32 * K * I / RPW, N, 1) threads, threadgroup (256, 1, 1).
// Requires H % 1024 == 0, I % RPW == 0, G % 32 == 0.
// Inputs: x [N, H]; inds [N, K] uint32; w [E, 2I, H/8] uint32; scales,
// biases [E, 2I, H/G]. Output: h [N, K, I] OutT.

constexpr int RPW = 2;              // row pairs per warp
constexpr int CPL = H / 1024;       // 32-value chunks per lane
constexpr int WPR = H / 8;          // uint32 words per weight row
constexpr int GPR = H / G;          // quantization groups per row
const int lane = threadIdx.x & 31;
const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
const int n = blockIdx.y;
if (warp * RPW >= K * I) {
  return;
}

// x chunks of this lane, and their sums (shared by every row).
float xr[CPL][32];
float xsum[CPL];
#pragma unroll
for (int i = 0; i < CPL; ++i) {
  const int c = lane + 32 * i;
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    xr[i][j] = static_cast<float>(x[(size_t)n * H + c * 32 + j]);
    s += xr[i][j];
  }
  xsum[i] = s;
}

#pragma unroll
for (int p = 0; p < RPW; ++p) {
  const int kr = warp * RPW + p;
  const int k = kr / I;
  const int r = kr - k * I;
  const uint32_t e = inds[(size_t)n * K + k];
  const size_t rows[2] = {(size_t)e * 2 * I + r, (size_t)e * 2 * I + I + r};
  float acc[2] = {0.f, 0.f};
#pragma unroll
  for (int t = 0; t < 2; ++t) {
    const uint4* wrow = reinterpret_cast<const uint4*>(w + rows[t] * WPR);
#pragma unroll
    for (int i = 0; i < CPL; ++i) {
      const int c = lane + 32 * i;
      const uint4 pk = wrow[c];
      const uint32_t words[4] = {pk.x, pk.y, pk.z, pk.w};
      float d = 0.f;
#pragma unroll
      for (int q = 0; q < 4; ++q) {
#pragma unroll
        for (int b = 0; b < 8; ++b) {
          d += qab_nibble(words[q], b) * xr[i][q * 8 + b];
        }
      }
      const size_t gi = rows[t] * GPR + (c * 32) / G;
      acc[t] += static_cast<float>(scales[gi]) * d + static_cast<float>(biases[gi]) * xsum[i];
    }
  }
  const float gate = qab_warp_sum(acc[0]);
  const float up = qab_warp_sum(acc[1]);
  if (lane == 0) {
    const float silu = gate / (1.f + expf(-gate));
    h[((size_t)n * K + k) * I + r] = static_cast<OutT>(silu * up);
  }
}
