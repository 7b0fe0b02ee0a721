// Decode, one launch for what a decoder layer runs between its mixer and its
// MoE experts: the residual add, the post-attention RMSNorm, the router's
// 8-bit GEMV and the route (softmax, top-K, renormalisation). Per token row n:
//
//   h[n]      = T(x[n] + r[n])
//   y[n]      = T(nw * T(h[n] * rsqrt(mean(h[n]^2) + eps)))
//   logits[n] = T(y[n] . dequantize(gw)^T)              [E] router logits (also an output)
//   inds[n], scores[n] = route(logits[n])                top-K experts and weights
//
// which the model otherwise runs as four to five MLX operations (an add and an
// RMSNorm or the add_rms_norm kernel, the router's quantized matmul, and the
// moe_router_topk kernel).
//
// Rounding, step by step as the stock operations round:
// * h and y as add_rms_norm.cu computes them (MLX's Add, then
//   mx.fast.rms_norm; only the order of the float32 sum of squares differs);
// * the logits as MLX 0.32's CUDA qmv kernel computes an 8-bit affine
//   quantized matmul of one row (mlx/backend/cuda/quantized/qmm/qmv.cu, read
//   for this kernel, not copied): lane l of the warp owning expert e takes the
//   8 elements [8 l + 256 s, 8 l + 256 s + 8) at step s; each weight is
//   dequantized in T arithmetic, w = T(T(q * scale) + bias); the products
//   y * w accumulate per element slot in float32 with fma, step after step;
//   the 8 slots are added in order, the 32 lanes by an xor butterfly (16, 8,
//   4, 2, 1, as cooperative_groups::reduce), and the sum rounded to T once.
//   Measured on the H200 against MLX 0.32.4's own quantized matmul of the same
//   y (tests/test_kernels_gpu.py): ~30 % of the logits bit-identical, the
//   largest difference 0.0625 in bf16 (logits of a few units; up to about an
//   ulp), the kernel's logits equal to a numpy model of the arithmetic above
//   in every element: the installed MLX sums otherwise than the source read.
//   Where logits an ulp apart decide the K-th expert, the two rank them
//   differently: the experts match stock's in 94.1 % of 512 random rows at
//   Qwen3.6's shape (E = 256, K = 8) in bf16, 84-89 % at E = 300 / 512, and
//   99.8-100 % in fp16;
// * the route by qab_route_row (moe_route_row.cuh), the arithmetic of
//   moe_router_topk.cu, over the row's logits read back into shared memory.
//
// NB = gridDim.x blocks per token row n (blockIdx.y), so the router's weights
// (512 KB at 8 bits for Qwen3.6) stream through NB SMs: block b computes the
// logits of experts [b EPB, b EPB + EPB). Phase 1 (every block, all
// threads): each thread holds elements t + BLOCK j of the row in registers,
// reduces the sum of squares (warp butterflies, one partial per warp in shared
// memory, every warp adding the partials in the same order) and keeps y in
// shared memory; block 0 writes h and y. Phase 2: warp w computes its RB
// expert rows and writes the logits; each lane's 8-byte weight loads and the
// scales and biases of all of them are issued before phase 1 (they depend on
// nothing), so their trip to memory overlaps the norm. Phase 3: every thread fences its
// writes, thread 0 counts the block in count[n]; the block that counts last
// fences again, reads the row's E logits back from L2 (qab_ldcg), routes them
// with warp 0 and resets count[n] to 0 (count: zeros for this launch, written
// through the const input; the callers pass a zero-strided view, which MLX
// copies into a fresh buffer for every launch, so launches that a CUDA graph
// runs concurrently never share one; the reset keeps a buffer reusable).
//
// Launch: grid (BLOCK * NB, N, 1) threads with NB = ceil(E / (RB BLOCK / 32)),
// threadgroup (BLOCK, 1, 1). Template: T (x, r, nw, gs, gb, h, y, logits,
// scores: bfloat16 or float16), D (hidden size, a multiple of 256), E
// (experts, <= 1024), K (1 <= K <= min(E, 32)), G (router quantization group
// size: 32, 64 or 128), NORM (bool: renormalise the K scores), BLOCK
// (threads, a multiple of 32, <= 1024), RB (expert rows per warp). Inputs:
// x, r [N, D] T (any leading axes, row-contiguous); nw [D] T; eps [4]
// float32 (element 0 read); gw [E, D / 4] uint32 (8 bits per weight, MLX's packing: byte j of
// a word is element 4 i + j); gs, gb [E, D / G] T; count [>= N] uint32.
// Outputs: h, y [N, D] T (x's shape); logits [N, E] T; inds [N, K] uint32,
// scores [N, K] T (slot K - 1 holds the largest probability).

static_assert(sizeof(T) == 2, "moe_add_norm_route: T is bfloat16 or float16");
static_assert(D % 256 == 0, "moe_add_norm_route: D % 256 == 0 (no residue step)");
static_assert(G % 8 == 0 && D % G == 0, "moe_add_norm_route: a lane's 8 weights share a group");
constexpr int WARPS = BLOCK / 32;
constexpr int PER = (D + BLOCK - 1) / BLOCK;
constexpr int EPT = 8;                 // weights per lane and step (MLX's qmv for 8 bits)
constexpr int STEPS = D / (32 * EPT);  // steps per row
constexpr int GPR = D / G;             // quantization groups per row
constexpr int EPB = WARPS * RB;        // experts per block
__shared__ __align__(16) T ys[D];
__shared__ T ls[E];
__shared__ float partial[WARPS];
__shared__ bool last;

const int t = threadIdx.x;
const int lane = t & 31;
const int warp = t >> 5;
const int part = blockIdx.x;
const size_t n = blockIdx.y;
const size_t base = n * D;

// This block's router weights, scales and biases: loaded first, so that their
// trip to memory overlaps phase 1 (they do not depend on it).
const uint8_t* wq = reinterpret_cast<const uint8_t*>(gw);
const int e0 = part * EPB + warp * RB;
uint2 q[RB][STEPS];
float qs[RB][STEPS];
float qb[RB][STEPS];
#pragma unroll
for (int b = 0; b < RB; ++b) {
  const int e = e0 + b < E ? e0 + b : E - 1;  // a padding row re-reads the last
#pragma unroll
  for (int s = 0; s < STEPS; ++s) {
    const int idx = lane * EPT + s * 32 * EPT;
    q[b][s] = *reinterpret_cast<const uint2*>(wq + (size_t)e * D + idx);
    qs[b][s] = static_cast<float>(gs[(size_t)e * GPR + idx / G]);
    qb[b][s] = static_cast<float>(gb[(size_t)e * GPR + idx / G]);
  }
}

// Phase 1: h = x + r, y = rms_norm(h) * nw (every block; block 0 writes them).
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
    if (part == 0) {
      h[base + i] = hr;
    }
    hv[j] = static_cast<float>(hr);
    ss += hv[j] * hv[j];
  }
}
ss = qab_warp_sum(ss);
if (lane == 0) {
  partial[warp] = ss;
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
    const T yv = static_cast<T>(static_cast<float>(nw[i]) * v);
    if (part == 0) {
      y[base + i] = yv;
    }
    ys[i] = yv;
  }
}
__syncthreads();

// Phase 2: this block's router logits, RB expert rows per warp.
{
#pragma unroll
  for (int b = 0; b < RB; ++b) {
    const int e = e0 + b < E ? e0 + b : E - 1;
    float sums[EPT];
#pragma unroll
    for (int i = 0; i < EPT; ++i) {
      sums[i] = 0.f;
    }
#pragma unroll
    for (int s = 0; s < STEPS; ++s) {
      const int idx = lane * EPT + s * 32 * EPT;
      const float sc = qs[b][s];
      const float bi = qb[b][s];
      const QabVec<T, EPT> yv = *reinterpret_cast<const QabVec<T, EPT>*>(ys + idx);
      const uint32_t words[2] = {q[b][s].x, q[b][s].y};
#pragma unroll
      for (int i = 0; i < EPT; ++i) {
        const float qv = static_cast<float>((words[i / 4] >> (8 * (i % 4))) & 255u);
        const float wd = static_cast<float>(
            static_cast<T>(static_cast<float>(static_cast<T>(qv * sc)) + bi));
        sums[i] = fmaf(static_cast<float>(yv.v[i]), wd, sums[i]);
      }
    }
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < EPT; ++i) {
      sum += sums[i];
    }
    sum = qab_warp_sum(sum);
    if (lane == 0 && e0 + b < E) {
      logits[n * E + e] = static_cast<T>(sum);
    }
  }
}

// Phase 3: the block that finishes the row last routes it.
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
for (int e = t; e < E; e += BLOCK) {
  ls[e] = qab_ldcg(logits + n * E + e);
}
__syncthreads();
if (warp == 0) {
  qab_route_row<T, E, K, NORM>(ls, lane, inds + n * K, scores + n * K);
}
if (t == 0) {
  const_cast<uint32_t*>(count)[n] = 0u;
}
