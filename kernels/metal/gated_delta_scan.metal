// Gated delta rule, sequential over T, for MLX's mx.fast.metal_kernel.
// Same contract as kernels/cuda/gated_delta_scan.cu: one SIMD group owns one
// state row (Dk floats, Dk/32 per lane, element i*32 + lane) for the whole
// scan; the row is read once and written once.
//
// Launch: grid (32, Dv, B*Hv) threads, threadgroup (32, R, 1) with R | Dv.
// Inputs: q, k [B, T, Hk, Dk] InT; v [B, T, Hv, Dv] InT; g, beta [B, T, Hv]
// float32; state_in [B, Hv, Dv, Dk] float32; mask [B, T] bool (read only when
// HAS_MASK). Outputs: y [B, T, Hv, Dv] InT; state_out [B, Hv, Dv, Dk] float32.
// This file cannot be compiled where the package is developed (no Apple GPU):
// on first use on a Metal device it is checked against the portable path and
// used only if it passes.

constexpr int NPER = Dk / 32;
const uint lane = thread_position_in_threadgroup.x;
const uint dv = thread_position_in_grid.y;
const uint bh = thread_position_in_grid.z;
if (dv >= uint(Dv)) {
  return;
}
const uint b = bh / Hv;
const uint hv = bh - b * Hv;
const uint hk = hv / (Hv / Hk);
const int T = q_shape[1];

const size_t row = (size_t(bh) * Dv + dv) * Dk;
float s[NPER];
for (int i = 0; i < NPER; ++i) {
  s[i] = state_in[row + i * 32 + lane];
}
for (int t = 0; t < T; ++t) {
  const size_t qk = ((size_t(b) * T + t) * Hk + hk) * Dk;
  const size_t gb = (size_t(b) * T + t) * Hv + hv;
  const size_t yo = gb * Dv + dv;
  if (HAS_MASK && !mask[size_t(b) * T + t]) {
    if (lane == 0) {
      y[yo] = static_cast<InT>(0.0f);
    }
    continue;
  }
  const float gc = g[gb];
  const float bc = beta[gb];
  float kc[NPER], qc[NPER];
  float kv = 0.0f;
  for (int i = 0; i < NPER; ++i) {
    kc[i] = static_cast<float>(k[qk + i * 32 + lane]);
    qc[i] = static_cast<float>(q[qk + i * 32 + lane]);
    s[i] *= gc;
    kv += s[i] * kc[i];
  }
  kv = simd_sum(kv);
  const float delta = (static_cast<float>(v[yo]) - kv) * bc;
  float out = 0.0f;
  for (int i = 0; i < NPER; ++i) {
    s[i] += kc[i] * delta;
    out += s[i] * qc[i];
  }
  out = simd_sum(out);
  if (lane == 0) {
    y[yo] = static_cast<InT>(out);
  }
}
for (int i = 0; i < NPER; ++i) {
  state_out[row + i * 32 + lane] = s[i];
}
