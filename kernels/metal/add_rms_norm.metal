// Residual add + RMSNorm in one launch; same contract as
// kernels/cuda/add_rms_norm.cu (read that file's comment):
//   h = T(x + r);  y = T(w * T(h * rsqrt(sum h^2 / D + eps)))
// with the rounding points of MLX's Add then mx.fast.rms_norm (float32 sum of
// squares of the rounded h, metal::precise::rsqrt as MLX's Metal kernel).
// One threadgroup per row, thread t holding elements t + BLOCK * j; simd_sum,
// one partial per SIMD group in threadgroup memory, one barrier.
// Never run where it was written: used only after its on-device self-check.
//
// Launch: grid (BLOCK * N, 1, 1) threads, threadgroup (BLOCK, 1, 1).
// Inputs: x, r [N, D] T; w [D] T; eps [4] float32 (element 0 read). Outputs: h, y [N, D] T.

constexpr int PER = (D + BLOCK - 1) / BLOCK;
constexpr int WARPS = BLOCK / 32;
threadgroup float partial[WARPS];

const int t = int(thread_position_in_threadgroup.x);
const int lane = int(thread_index_in_simdgroup);
const int sg = int(simdgroup_index_in_threadgroup);
const size_t base = size_t(threadgroup_position_in_grid.x) * D;

float hv[PER];
float rv[PER];
for (int j = 0; j < PER; ++j) {
  const int i = t + BLOCK * j;
  hv[j] = i < D ? static_cast<float>(x[base + i]) : 0.0f;
  rv[j] = i < D ? static_cast<float>(r[base + i]) : 0.0f;
}
float ss = 0.0f;
for (int j = 0; j < PER; ++j) {
  const int i = t + BLOCK * j;
  if (i < D) {
    const T hr = static_cast<T>(hv[j] + rv[j]);
    h[base + i] = hr;
    hv[j] = static_cast<float>(hr);
    ss += hv[j] * hv[j];
  }
}
ss = simd_sum(ss);
if (lane == 0) {
  partial[sg] = ss;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
float total = lane < WARPS ? partial[lane] : 0.0f;
total = simd_sum(total);
const float inv = metal::precise::rsqrt(total / float(D) + eps[0]);

for (int j = 0; j < PER; ++j) {
  const int i = t + BLOCK * j;
  if (i < D) {
    const float v = static_cast<float>(static_cast<T>(hv[j] * inv));
    y[base + i] = static_cast<T>(static_cast<float>(w[i]) * v);
  }
}
