// Grouped 4-bit GEMM over token rows sorted by expert (MoE prefill), on the
// bf16 tensor cores (mma.sync m16n8k16, float32 accumulation).
//
//   y[m, c] = x[m] . W[e(m), c]                       (GLU = false)
//   y[m, c] = silu(x[m] . W[e, c]) * (x[m] . W[e, NOUT + c])   (GLU = true)
// for rows m of expert e = the expert whose row range holds m. W is packed
// 8 nibbles per uint32 (MLX affine layout) with scales/biases per G = 64
// inputs; each 64-wide K step dequantizes the needed weight tile into shared
// memory right before the multiply (no float copy of the experts in global
// memory).
//
// Tiles, sized by expert load: a block owns tile_rows[e] (16, 32 or 64) rows
// of one expert e and BN = 64 output columns (and, with GLU, the matching 64
// "up" columns); ops/moe.grouped_gemm_block_map picks each expert's tile
// height from its row count, so an expert with 5 rows runs one 16-row tile
// instead of a 64-row one that is mostly zeros. tile_offsets[e] is the first
// tile of expert e (exclusive scan of ceil(rows_e / tile_rows_e)); a block
// finds its expert by binary search, so the launch needs no host sync: blocks
// past the last tile exit. The tile itself: kernels/cuda/moe_grouped_gemm_tile.cuh.
//
// Launch: grid (128 * n_tiles_max, NOUT / 64, 1) threads, threadgroup (128, 1, 1),
// n_tiles_max = M / 64 + E (an upper bound on the tile count: an expert with
// at most 64 rows has one tile, a larger one ceil(rows / 64)).
// Inputs: x [M, KDIM] bf16; w [E, R, KDIM/8] uint32 (R = 2 NOUT with GLU, else
// NOUT); scales, biases [E, R, KDIM/64] bf16; row_offsets, tile_offsets
// [E + 1] int32; tile_rows [E] int32. Output: y [M, NOUT] bf16.

__shared__ __align__(16) __nv_bfloat16 xs[64 * 72];
__shared__ __align__(16) __nv_bfloat16 ws[(GLU ? 2 : 1) * 64 * 72];

const int tile = blockIdx.x;
const int col0 = blockIdx.y * 64;
if (tile >= tile_offsets[E]) {
  return;
}
int lo = 0, hi = E;  // tile_offsets[lo] <= tile < tile_offsets[hi]
while (hi - lo > 1) {
  const int mid = (lo + hi) >> 1;
  if (tile_offsets[mid] <= tile) lo = mid; else hi = mid;
}
const int e = lo;
const int bm = tile_rows[e];
const int row0 = row_offsets[e] + (tile - tile_offsets[e]) * bm;
const int row_end = min(row0 + bm, row_offsets[e + 1]);
if (bm == 16) {
  qab_grouped_gemm_tile<16, KDIM, NOUT, GLU>(x, w, scales, biases, y, e, row0, row_end, col0,
                                             xs, ws);
} else if (bm == 32) {
  qab_grouped_gemm_tile<32, KDIM, NOUT, GLU>(x, w, scales, biases, y, e, row0, row_end, col0,
                                             xs, ws);
} else {
  qab_grouped_gemm_tile<64, KDIM, NOUT, GLU>(x, w, scales, biases, y, e, row0, row_end, col0,
                                             xs, ws);
}
