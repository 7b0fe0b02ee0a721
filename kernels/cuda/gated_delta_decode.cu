// One decode token of a whole Gated DeltaNet layer, short of its projections,
// in one launch, for MLX's mx.fast.cuda_kernel: one block of BLOCK threads per
// (batch row b, value head hv) runs qab_gdn_decode_head (gated_delta_decode.cuh:
// the algorithm, its rounding points and the H200 mapping).
//
// Launch: grid (BLOCK, B * Hv, 1) threads, threadgroup (BLOCK, 1, 1).
// Inputs: qkv [B, 2 Hk Dk + Hv Dv] InT (channels q | k | v); z [B, Hv * Dv] InT;
// (with PROJ_W > 0, qkv, z, b_proj and a_proj are one [B, PROJ_W] InT array,
// channels q | k | v | z | b | a);
// b_proj, a_proj [B, Hv] InT; conv_state [B, Kc - 1, conv_dim] InT; conv_w
// [conv_dim, Kc, 1] WT; conv_b [conv_dim] WT (read only when HAS_BIAS);
// A_log [Hv] float32; dt_bias [Hv] WT; norm_w [Dv] WT; norm_eps [4] float32 (element 0 read);
// state_in [B, Hv, Dv, Dk] float32; mask [B] bool (read only when HAS_MASK);
// lengths [B] int32 (read only when HAS_LENGTHS).
// Outputs: out [B, Hv, Dv] InT; conv_state_out [B, Kc - 1, conv_dim] InT;
// state_out [B, Hv, Dv, Dk] float32.

// The dispatcher passes conv_w, conv_b, dt_bias and norm_w in WT (MLX's kernel
// cache is keyed by the template arguments only): the call below does not
// compile otherwise.
const int b = blockIdx.y / Hv;
qab_gdn_decode_head<InT, WT, Hk, Hv, Dk, Dv, Kc, BLOCK, HAS_BIAS, HAS_MASK, HAS_LENGTHS, PROJ_W>(
    b, blockIdx.y - b * Hv, qkv, z, b_proj, a_proj, conv_state, conv_w, conv_b, A_log, dt_bias,
    norm_w, norm_eps, state_in, mask, lengths, out, conv_state_out, state_out);
