// Residual add + RMSNorm in one launch, per row n of D elements:
//
//   h[n, i] = T(x[n, i] + r[n, i])
//   y[n, i] = T(w[i] * T(h[n, i] * rsqrt(sum_i h[n, i]^2 / D + eps)))
//
// with the rounding points of MLX's Add followed by mx.fast.rms_norm(h, w,
// eps): the sum of squares is float32 over the ROUNDED h, the normalised value
// is rounded to T before the weight multiply, whose product is rounded once
// (the product of two T values is exact in float32, so T(float(w) * float(v))
// equals T arithmetic). Only the order of the float32 sum differs from MLX's
// kernels. For T = float32 every rounding is a no-op.
//
// One block per row. Thread t holds elements i = t + BLOCK * j (j < PER) of
// its row in registers: coalesced loads, all issued before any arithmetic,
// h never read back. The sum of squares reduces by a warp butterfly, one
// partial per warp in shared memory, then every warp adds the partials in the
// same order, so every thread gets the same total after one barrier.
//
// Launch: grid (BLOCK * N, 1, 1) threads, threadgroup (BLOCK, 1, 1).
// BLOCK a multiple of 32, at most 1024. Any D >= 1 (PER = ceil(D / BLOCK)).
// Inputs: x, r [N, D] T; w [D] T; eps [4] float32 (element 0 read). Outputs: h, y [N, D] T.

constexpr int PER = (D + BLOCK - 1) / BLOCK;
constexpr int WARPS = BLOCK / 32;
__shared__ float partial[WARPS];

const int t = threadIdx.x;
const size_t base = (size_t)blockIdx.x * D;

float hv[PER];
float rv[PER];
#pragma unroll
for (int j = 0; j < PER; ++j) {
  const int i = t + BLOCK * j;
  hv[j] = i < D ? static_cast<float>(x[base + i]) : 0.f;
  rv[j] = i < D ? static_cast<float>(r[base + i]) : 0.f;
}
float ss = 0.f;
#pragma unroll
for (int j = 0; j < PER; ++j) {
  const int i = t + BLOCK * j;
  if (i < D) {
    const T hr = static_cast<T>(hv[j] + rv[j]);
    h[base + i] = hr;
    hv[j] = static_cast<float>(hr);
    ss += hv[j] * hv[j];
  }
}
ss = qab_warp_sum(ss);
const int lane = t & 31;
if (lane == 0) {
  partial[t >> 5] = ss;
}
__syncthreads();
float total = lane < WARPS ? partial[lane] : 0.f;
total = qab_warp_sum(total);
const float inv = rsqrtf(total / static_cast<float>(D) + eps[0]);

#pragma unroll
for (int j = 0; j < PER; ++j) {
  const int i = t + BLOCK * j;
  if (i < D) {
    const float v = static_cast<float>(static_cast<T>(hv[j] * inv));
    y[base + i] = static_cast<T>(static_cast<float>(w[i]) * v);
  }
}
