// Gated delta rule, sequential over T, for MLX's mx.fast.cuda_kernel.
//
// Recurrence (Yang et al., "Gated Delta Networks", ICLR 2025), per batch row b,
// value head hv, value row dv of the state S[b, hv] of shape [Dv, Dk]:
//   s     = g_t * s
//   delta = beta_t * (v_t[dv] - <s, k_t>)
//   s     = s + delta * k_t
//   y_t[dv] = <s, q_t>
// One warp owns one state row s (Dk floats) for the whole scan: each lane keeps
// Dk/32 of them in registers (element i*32 + lane, so loads coalesce), the row
// is read once and written once. Value head hv reads key head hv / (Hv / Hk).
// The next token's inputs are loaded before the current token's math, so their
// latency overlaps the two warp reductions.
//
// Launch: grid (32, Dv, B*Hv) threads, threadgroup (32, R, 1) with R | Dv.
// Inputs: q, k [B, T, Hk, Dk] InT; v [B, T, Hv, Dv] InT; g, beta [B, T, Hv]
// float32; state_in [B, Hv, Dv, Dk] float32; mask [B, T] bool (read only when
// HAS_MASK). Outputs: y [B, T, Hv, Dv] InT; state_out [B, Hv, Dv, Dk] float32.

constexpr int NPER = Dk / 32;
const int lane = threadIdx.x;
const int dv = blockIdx.y * blockDim.y + threadIdx.y;
const int bh = blockIdx.z;
if (dv >= Dv) {
  return;
}
const int b = bh / Hv;
const int hv = bh - b * Hv;
const int hk = hv / (Hv / Hk);
const int T = q_shape[1];

const size_t row = ((size_t)bh * Dv + dv) * Dk;
float s[NPER];
#pragma unroll
for (int i = 0; i < NPER; ++i) {
  s[i] = state_in[row + i * 32 + lane];
}

// Prefetched inputs of token t.
float kn[NPER], qn[NPER];
float vn = 0.f, gn = 0.f, bn = 0.f;
bool mn = true;
auto load = [&](int t) {
  const size_t qk = (((size_t)b * T + t) * Hk + hk) * Dk;
  const size_t gb = ((size_t)b * T + t) * Hv + hv;
#pragma unroll
  for (int i = 0; i < NPER; ++i) {
    kn[i] = static_cast<float>(k[qk + i * 32 + lane]);
    qn[i] = static_cast<float>(q[qk + i * 32 + lane]);
  }
  vn = static_cast<float>(v[gb * Dv + dv]);
  gn = g[gb];
  bn = beta[gb];
  if (HAS_MASK) {
    mn = mask[(size_t)b * T + t];
  }
};
if (T > 0) {
  load(0);
}
for (int t = 0; t < T; ++t) {
  float kc[NPER], qc[NPER];
#pragma unroll
  for (int i = 0; i < NPER; ++i) {
    kc[i] = kn[i];
    qc[i] = qn[i];
  }
  const float vc = vn, gc = gn, bc = bn;
  const bool mc = mn;
  if (t + 1 < T) {
    load(t + 1);
  }
  const size_t yo = (((size_t)b * T + t) * Hv + hv) * Dv + dv;
  if (!mc) {
    if (lane == 0) {
      y[yo] = static_cast<InT>(0.f);
    }
    continue;
  }
  float kv = 0.f;
#pragma unroll
  for (int i = 0; i < NPER; ++i) {
    s[i] *= gc;
    kv += s[i] * kc[i];
  }
  kv = qab_warp_sum(kv);
  const float delta = (vc - kv) * bc;
  float out = 0.f;
#pragma unroll
  for (int i = 0; i < NPER; ++i) {
    s[i] += kc[i] * delta;
    out += s[i] * qc[i];
  }
  out = qab_warp_sum(out);
  if (lane == 0) {
    y[yo] = static_cast<InT>(out);
  }
}
#pragma unroll
for (int i = 0; i < NPER; ++i) {
  state_out[row + i * 32 + lane] = s[i];
}
