// Decode: moe_down_shared_gemv.cu with the NEXT decoder layer's input RMSNorm
// in its epilogue. Per token row n:
//
//   y[n]  = res[n] + block_output[n]                 (as moe_down_shared_gemv, HAS_RES)
//   yn[n] = T(nw * T(y[n] * rsqrt(mean(y[n]^2) + eps)))
//
// so the next layer's mixer reads yn and its RMSNorm launch is gone: one MLX
// operation less per layer and token (decode on MLX's CUDA backend is bound by
// the host's per-operation cost). yn is what mx.fast.rms_norm(y, nw, eps)
// computes, with its rounding points (add_rms_norm.cu), from the ROUNDED y;
// only the order of the float32 sum of squares differs.
//
// The norm needs the whole row, which many blocks write. Each block's threads
// fence their y writes (__threadfence) and meet at a barrier; thread 0 then
// increments count[n]; the block that sees the last count (gridDim.x - 1)
// fences again, reads the row back from L2 (__ldcg: the other blocks' writes
// are not in this SM's L1), normalises it, writes yn, and resets count[n] to 0.
// count must be zeros for this launch and no other launch's: the callers pass
// a zero-strided view (ops/moe.py fold_norm_counter), which MLX copies into a
// fresh buffer for every launch; the kernel writes that copy through the
// const input (as kv_cache_write.cu writes the KV cache), and the reset keeps a
// buffer reusable.
//
// Launch: grid (32 * H / 2, N, 1) threads, threadgroup (BLOCK, 1, 1) (as
// moe_down_shared_gemv.cu; its header moe_down_shared.cuh computes the rows).
// Requires I % 32 == 0, H % (2 * BLOCK / 32) == 0, G % 32 == 0.
// Template: as moe_down_shared_gemv.cu with HAS_RES, plus BLOCK (threads per
// block, a multiple of 32).
// Inputs: those of moe_down_shared_gemv.cu (res the residual, [N, H] OutT);
// nw [H] OutT (the next layer's input_layernorm weight); neps [4] float32 (element 0 read);
// count [>= N] uint32 (zeros, this launch's own; see above). Outputs: y, yn [N, H] OutT (the
// caller's [B, T, H]).

constexpr int WARPS = BLOCK / 32;
constexpr int PER = (H + BLOCK - 1) / BLOCK;
__shared__ float partial[WARPS];
__shared__ bool last;

const int t = threadIdx.x;
const int lane = t & 31;
const int warp = (blockIdx.x * blockDim.x + t) >> 5;
const int n = blockIdx.y;
if (warp * QAB_DOWN_RPW < H) {
  qab_moe_down_shared_rows<OutT, H, I, K, G, true>(warp, lane, n, h, inds, scores, w, scales,
                                                   biases, s_down_w, s_down_scales,
                                                   s_down_biases, sg_logit, res, y);
}
__threadfence();
__syncthreads();
if (t == 0) {
  const unsigned int prev = atomicAdd(const_cast<uint32_t*>(count) + n, 1u);
  last = prev == gridDim.x - 1;
}
__syncthreads();
if (!last) {
  return;
}
__threadfence();

// The last block: RMSNorm of the finished row.
const size_t base = (size_t)n * H;
float v[PER];
float ss = 0.f;
#pragma unroll
for (int j = 0; j < PER; ++j) {
  const int i = t + BLOCK * j;
  v[j] = i < H ? static_cast<float>(qab_ldcg(y + base + i)) : 0.f;
  ss += v[j] * v[j];
}
ss = qab_warp_sum(ss);
if (lane == 0) {
  partial[t >> 5] = ss;
}
__syncthreads();
float total = lane < WARPS ? partial[lane] : 0.f;
total = qab_warp_sum(total);
const float inv = rsqrtf(total / static_cast<float>(H) + neps[0]);
#pragma unroll
for (int j = 0; j < PER; ++j) {
  const int i = t + BLOCK * j;
  if (i < H) {
    const float u = static_cast<float>(static_cast<OutT>(v[j] * inv));
    yn[base + i] = static_cast<OutT>(static_cast<float>(nw[i]) * u);
  }
}
if (t == 0) {
  const_cast<uint32_t*>(count)[n] = 0u;
}
