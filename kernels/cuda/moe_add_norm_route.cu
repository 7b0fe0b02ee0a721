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
// The work is qab_add_norm_route_part (moe_add_norm_route.cuh).
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

(void)qab_add_norm_route_part<T, D, E, K, G, NORM, BLOCK, RB>(
    blockIdx.x, gridDim.x, blockIdx.y, x, r, nw, eps, gw, gs, gb, count, h, y, logits, inds,
    scores);
