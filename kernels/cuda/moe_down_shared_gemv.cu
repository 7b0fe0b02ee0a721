// Decode, 4-bit affine: the K routed experts' down projections weighted by the
// routing scores, plus the shared expert's down projection weighted by
// sigmoid(sg_logit), summed; the second kernel of moe_gate_up_shared_gemv.cu.
//
// For token n and output row o:
//   y[n, o] = sum_k scores[n, k] * (h[n, k] . W[inds[n, k], o])
//           + sigmoid(sg_logit[n]) * (h[n, K] . s_down[o])
// W is [E, H, I] packed 8 nibbles per uint32 (MLX affine layout) with scales,
// biases [E, H, I / G]; s_down is the shared expert's [H, I] down_proj with
// the same packing and G, its scales and biases of the routed ones' dtype.
// One warp computes RPW output rows; the (K + 1) * I / 32 (slot, 32-value
// chunk) tasks of a row are spread over the lanes (16-byte weight loads, all
// of a warp's rows issued before any arithmetic; h in 16-byte loads through
// L1, where every warp of the block shares it: moe_down_shared.cuh); each
// lane weights its partial dot products by the slot's weight, and one warp
// reduction per row finishes the sum. Float32 throughout; y rounded once.
// With HAS_RES the decoder layer's residual is added in the epilogue, as the
// stock layer adds it (`h + mlp(...)`: the block output rounded to OutT, then
// the sum rounded), which saves the model one Add launch per layer and token.
//
// Launch: grid (32 * H / RPW, N, 1) threads, threadgroup (256, 1, 1).
// Requires I % 32 == 0, H % RPW == 0, G % 32 == 0.
// Template: OutT (y), H, I, K, G (group size), ST (scores' dtype: float,
// bfloat16 or float16, read as float; the router's own dtype, so no cast op),
// HAS_RES (bool: add res).
// Inputs: h [N, K+1, I]; inds [N, K] uint32; scores [N, K] ST; w [E, H,
// I/8] uint32; scales, biases [E, H, I/G]; s_down_w [H, I/8] uint32;
// s_down_scales, s_down_biases [H, I/G]; sg_logit [>= N] float32; res [N, H]
// OutT (the residual; without HAS_RES any OutT array, not read).
// Output: y [N, H] OutT (any leading axes with N rows: the caller's [B, T, H]).
// Header: moe_down_shared.cuh (the rows, shared with moe_down_shared_norm_gemv.cu).

const int lane = threadIdx.x & 31;
const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
const int n = blockIdx.y;
if (warp * QAB_DOWN_RPW >= H) {
  return;
}
qab_moe_down_shared_rows<OutT, H, I, K, G, HAS_RES>(warp, lane, n, h, inds, scores, w, scales,
                                                   biases, s_down_w, s_down_scales,
                                                   s_down_biases, sg_logit, res, y);
