// Decode (a few tokens), 4-bit affine: the K routed experts' gate+up rows AND
// the shared expert's, as K + 1 slots, plus the shared expert's gate logit.
//
// For token n, slot k < K with expert e = inds[n, k], and r < I:
//   h[n, k, r] = silu(x[n] . W[e, r]) * (x[n] . W[e, I + r])
// slot K is the shared expert (its own gate_proj / up_proj arrays, [I, H]):
//   h[n, K, r] = silu(x[n] . s_gate[r]) * (x[n] . s_up[r])
// and one more warp per token computes the shared expert gate's logit
//   sg_logit[n] = x[n] . sg_w[0]          (float32, no sigmoid here)
// from its SGB-bit (4 or 8) affine row with groups of SGG inputs.
// W is the fused [E, 2I, H] gate+up weight packed 8 nibbles per uint32 (MLX's
// affine layout: value j of a word at bits 4j), with one scale and bias per G
// consecutive inputs; the shared expert's gate_proj / up_proj use the same
// packing and G (8-bit rows: 4 values per word, value j at bits 8j).
// Dequantized dot: sum_j (s q_j + b) x_j = s * sum_j q_j x_j + b * sum_j x_j.
// As in moe_gate_up_gemv.cu: one warp computes RPW (gate, up) row pairs; each
// lane owns the 32-value chunks c = lane + 32 i of a row (16-byte loads,
// coalesced across the warp). A warp issues every weight, scale and bias load
// of its RPW row pairs before any arithmetic (loads in flight are what a GEMV
// at batch 1 lives on); x is staged once per block in shared memory as float,
// chunk-transposed (xs[j / 4][c] holds x[32 c + j .. + 3]: lanes reading
// consecutive chunks hit consecutive 16-byte words), with each chunk's sum.
// The shared slot's scales and biases must have the routed ones' dtype (one
// pointer type for both).
//
// The work is qab_moe_gate_up_shared_part (moe_gate_up_shared.cuh).
//
// Launch: grid (32 * NW, N, 1) threads, threadgroup (256, 1, 1), with NW =
// (K + 1) * I / RPW + 1 warps rounded up to a multiple of 8; spare warps exit.
// Requires H % 1024 == 0, I % RPW == 0, G % 32 == 0, SGG % 32 == 0, and
// H * 4 + H / 8 bytes of shared memory (8.25 KB at H = 2,048).
// Inputs: x [N, H]; inds [N, K] uint32; w [E, 2I, H/8] uint32; scales, biases
// [E, 2I, H/G]; s_gate_w, s_up_w [I, H/8] uint32; s_gate_scales,
// s_gate_biases, s_up_scales, s_up_biases [I, H/G]; sg_w [1, H*SGB/32]
// uint32; sg_scales, sg_biases [1, H/SGG].
// Outputs: h [N, K+1, I] OutT; sg_logit [max(N, 4)] float32 (element n per
// token row; at least 16 bytes, see ops.device.unpooled_length; the elements
// past N are written 0 and never read).

qab_moe_gate_up_shared_part<OutT, H, I, K, G, SGB, SGG, false, QAB_GATE_UP_RPW>(
    blockIdx.x, blockIdx.y, gridDim.y, qab_row_load<false>(x + (size_t)blockIdx.y * H), inds, w,
    scales, biases, s_gate_w, s_gate_scales, s_gate_biases, s_up_w, s_up_scales, s_up_biases,
    sg_w, sg_scales, sg_biases, h, sg_logit);
