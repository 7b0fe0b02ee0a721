// MoE prefill epilogue: un-sort the experts' output rows, weight them by the
// routing scores, sum over K and add the gated shared expert, in one pass.
//
//   out[n, c] = sum_k scores[n, k] * y[slot_row[n, k], c]
//             + sigmoid(sg_logit[n]) * shared[n, c]
// y holds one row per (token, slot) in expert order (the grouped GEMM's
// output); slot_row[n, k] is the row of token n's slot k (the inverse of the
// sort permutation). Float32 accumulation over k in slot order; out rounded
// once.
// One thread per output element: a warp reads 32 consecutive columns of a row.
//
// Launch: grid (HP, N, 1) threads, threadgroup (256, 1, 1), with HP = H
// rounded up to a multiple of 256; threads past column H exit.
// Inputs: y [M, H]; slot_row [N, K] uint32; scores [N, K]; shared [N, H];
// sg_logit [N]. Output: out [N, H] OutT.

const int c = blockIdx.x * blockDim.x + threadIdx.x;
const int n = blockIdx.y;
if (c >= H) {
  return;
}
float acc = 0.f;
#pragma unroll
for (int k = 0; k < K; ++k) {
  const size_t row = slot_row[(size_t)n * K + k];
  acc += static_cast<float>(scores[(size_t)n * K + k]) * static_cast<float>(y[row * H + c]);
}
const float g = static_cast<float>(sg_logit[n]);
acc += static_cast<float>(shared[(size_t)n * H + c]) / (1.f + expf(-g));
out[(size_t)n * H + c] = static_cast<OutT>(acc);
