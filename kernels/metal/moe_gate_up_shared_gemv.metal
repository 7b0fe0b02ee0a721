// Decode, 4-bit affine: the K routed experts' gate+up rows and the shared
// expert's (slot K), plus the shared expert gate's logit; same contract as
// kernels/cuda/moe_gate_up_shared_gemv.cu (read that file's comment), except
// that sg_logit's elements past N rows are left unwritten (nothing reads them). One
// SIMD group computes RPW (gate, up) row pairs, one more per token the gate
// logit; lane-owned 32-value chunks, x in registers, simd_sum reductions.
// Never run where it was written: used only after its on-device self-check
// passes.
//
// Launch: grid (32 * NW, N, 1) threads, threadgroup (256, 1, 1), with NW =
// (K + 1) * I / RPW + 1 warps rounded up to a multiple of 8; spare warps exit.

constexpr int RPW = 2;
constexpr int CPL = H / 1024;
constexpr int WPR = H / 8;
constexpr int GPR = H / G;
constexpr int KS = K + 1;
constexpr int NRW = KS * I / RPW;
const uint lane = thread_index_in_simdgroup;
const uint warp = thread_position_in_grid.x / 32;
const uint n = thread_position_in_grid.y;
if (warp > uint(NRW)) {
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

if (warp == uint(NRW)) {
  // The shared expert gate's single row: a 32-value chunk is SGB words.
  constexpr int VPW = 32 / SGB;
  constexpr uint MASK = (1u << SGB) - 1u;
  float acc = 0.0f;
  for (int i = 0; i < CPL; ++i) {
    const uint c = lane + 32 * i;
    const device uint4* src = (const device uint4*)(sg_w + size_t(c) * SGB);
    float d = 0.0f;
    for (int v = 0; v < SGB / 4; ++v) {
      const uint4 pk = src[v];
      for (int q = 0; q < 4; ++q) {
        const uint word = pk[q];
        for (int b = 0; b < VPW; ++b) {
          d += float((word >> (SGB * b)) & MASK) * xr[i][(v * 4 + q) * VPW + b];
        }
      }
    }
    const uint gi = (c * 32) / SGG;
    acc += static_cast<float>(sg_scales[gi]) * d + static_cast<float>(sg_biases[gi]) * xsum[i];
  }
  acc = simd_sum(acc);
  if (lane == 0) {
    sg_logit[n] = acc;
  }
  return;
}

for (int p = 0; p < RPW; ++p) {
  const uint kr = warp * RPW + p;
  const uint k = kr / I;
  const uint r = kr - k * I;
  const bool is_shared = k == uint(K);
  // Slot K reads the shared expert's own arrays; inds has no column K.
  const size_t e = is_shared ? size_t(0) : size_t(inds[size_t(n) * K + k]);
  const size_t gate_row = e * 2 * I + r;
  const size_t up_row = gate_row + I;
  const device uint* wg = is_shared ? s_gate_w + size_t(r) * WPR : w + gate_row * WPR;
  const device uint* wu = is_shared ? s_up_w + size_t(r) * WPR : w + up_row * WPR;
  auto sgp = is_shared ? s_gate_scales + size_t(r) * GPR : scales + gate_row * GPR;
  auto bgp = is_shared ? s_gate_biases + size_t(r) * GPR : biases + gate_row * GPR;
  auto sup = is_shared ? s_up_scales + size_t(r) * GPR : scales + up_row * GPR;
  auto bup = is_shared ? s_up_biases + size_t(r) * GPR : biases + up_row * GPR;
  float acc[2] = {0.0f, 0.0f};
  for (int t = 0; t < 2; ++t) {
    const device uint4* wrow = (const device uint4*)(t ? wu : wg);
    auto srow = t ? sup : sgp;
    auto brow = t ? bup : bgp;
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
      const uint gi = (c * 32) / G;
      acc[t] += static_cast<float>(srow[gi]) * d + static_cast<float>(brow[gi]) * xsum[i];
    }
  }
  const float gate = simd_sum(acc[0]);
  const float up = simd_sum(acc[1]);
  if (lane == 0) {
    const float silu = gate / (1.0f + metal::exp(-gate));
    h[(size_t(n) * KS + k) * I + r] = static_cast<OutT>(silu * up);
  }
}
