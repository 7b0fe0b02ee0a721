// MoE prefill epilogue: un-sort, weight by the routing scores, sum over K and
// add the gated shared expert in one pass; same contract as
// kernels/cuda/moe_combine.cu (read that file's comment). Never run where it
// was written: used only after its on-device self-check passes.
//
// Launch: grid (HP, N, 1) threads, threadgroup (256, 1, 1), with HP = H
// rounded up to a multiple of 256; threads past column H exit.

const uint c = thread_position_in_grid.x;
const uint n = thread_position_in_grid.y;
if (c >= uint(H)) {
  return;
}
float acc = 0.0f;
for (int k = 0; k < K; ++k) {
  const size_t row = slot_row[size_t(n) * K + k];
  acc += static_cast<float>(scores[size_t(n) * K + k]) * static_cast<float>(y[row * H + c]);
}
const float g = static_cast<float>(sg_logit[n]);
acc += static_cast<float>(shared[size_t(n) * H + c]) / (1.0f + metal::exp(-g));
out[size_t(n) * H + c] = static_cast<OutT>(acc);
