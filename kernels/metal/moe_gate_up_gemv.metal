// Routed experts' gate+up projection for decode, 4-bit affine; same contract
// as kernels/cuda/moe_gate_up_gemv.cu (read that file's comment). One SIMD
// group computes RPW (gate, up) row pairs; lane-owned 32-value chunks, x in
// registers, simd_sum reductions. Never run where it was written: used only
// after its on-device self-check passes.
//
// Launch: grid (32 * K * I / RPW, N, 1) threads, threadgroup (256, 1, 1).

constexpr int RPW = 2;
constexpr int CPL = H / 1024;
constexpr int WPR = H / 8;
constexpr int GPR = H / G;
const uint lane = thread_index_in_simdgroup;
const uint warp = thread_position_in_grid.x / 32;
const uint n = thread_position_in_grid.y;
if (warp * RPW >= uint(K * I)) {
  return;
}
float xr[CPL][32];
float xsum[CPL];
for (int i = 0; i < CPL; ++i) {
  const uint c = lane + 32 * i;
  float s = 0.0f;
  for (int j = 0; j < 32; ++j) {
    xr[i][j] = static_cast<float>(x[size_t(n) * H + c * 32 + j]);
    s += xr[i][j];
  }
  xsum[i] = s;
}
for (int p = 0; p < RPW; ++p) {
  const uint kr = warp * RPW + p;
  const uint k = kr / I;
  const uint r = kr - k * I;
  const uint e = inds[size_t(n) * K + k];
  const size_t rows[2] = {size_t(e) * 2 * I + r, size_t(e) * 2 * I + I + r};
  float acc[2] = {0.0f, 0.0f};
  for (int t = 0; t < 2; ++t) {
    const device uint4* wrow = (const device uint4*)(w + rows[t] * WPR);
    for (int i = 0; i < CPL; ++i) {
      const uint c = lane + 32 * i;
      const uint4 pk = wrow[c];
      float d = 0.0f;
      for (int q = 0; q < 4; ++q) {
        const uint word = pk[q];
        for (int b = 0; b < 8; ++b) {
          d += float((word >> (4 * b)) & 15u) * xr[i][q * 8 + b];
        }
      }
      const size_t gi = rows[t] * GPR + (c * 32) / G;
      acc[t] += static_cast<float>(scales[gi]) * d + static_cast<float>(biases[gi]) * xsum[i];
    }
  }
  const float gate = simd_sum(acc[0]);
  const float up = simd_sum(acc[1]);
  if (lane == 0) {
    const float silu = gate / (1.0f + metal::exp(-gate));
    h[(size_t(n) * K + k) * I + r] = static_cast<OutT>(silu * up);
  }
}
