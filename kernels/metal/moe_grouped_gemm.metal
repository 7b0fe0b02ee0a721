// Grouped 4-bit GEMM over token rows sorted by expert (MoE prefill), on the
// SIMD-group matrix units (simdgroup_matrix<float, 8, 8>, float32 accumulation).
// Same contract as kernels/cuda/moe_grouped_gemm.cu (read that file's comment):
//
//   y[m, c] = x[m] . W[e(m), c]                                (GLU = false)
//   y[m, c] = silu(x[m] . W[e, c]) * (x[m] . W[e, NOUT + c])   (GLU = true)
//
// Never run where it was written: used only after its on-device self-check
// passes.
//
// Tiles as in the CUDA kernel, sized by expert load: a threadgroup owns
// tile_rows[e] (16, 32 or 64) rows of one expert and BN = 64 output columns
// (with GLU also the matching 64 "up" columns); tile_offsets[e] is the first
// tile of expert e, found by binary search; threadgroups past the last tile
// return; rows at or past the expert's last row are read as zeros and never
// written. The tile itself: kernels/metal/moe_grouped_gemm_tile.metal.
// Threadgroup memory: 27.5 KB with GLU, 19.5 KB without (the limit is 32 KB).
//
// Launch: grid (128 * n_tiles_max, NOUT / 64, 1) threads, threadgroup (128, 1, 1),
// n_tiles_max = M / 64 + E (an upper bound on the tile count).
// Inputs: x [M, KDIM] bf16; w [E, R, KDIM/8] uint32 (R = 2 NOUT with GLU, else
// NOUT; 8 nibbles per word, low nibble first); scales, biases [E, R, KDIM/64]
// bf16; row_offsets, tile_offsets [E + 1] int32; tile_rows [E] int32.
// Output: y [M, NOUT] bf16. Requires KDIM % 64 == 0 and NOUT % 64 == 0.

static_assert(KDIM % 64 == 0 && NOUT % 64 == 0, "KDIM and NOUT must be multiples of 64");
threadgroup float xs[64 * 36];
threadgroup float ws[32 * ((GLU ? 2 : 1) * 64 + 4)];
threadgroup float cs[4 * 2 * 64];

const int tid = int(thread_index_in_threadgroup);
const int lane = int(thread_index_in_simdgroup);
const int sgid = int(simdgroup_index_in_threadgroup);
const int tile = int(threadgroup_position_in_grid.x);
const int col0 = int(threadgroup_position_in_grid.y) * 64;
if (tile >= tile_offsets[E]) {
  return;  // whole threadgroup: past the last tile
}
int lo = 0, hi = E;  // tile_offsets[lo] <= tile < tile_offsets[hi]
while (hi - lo > 1) {
  const int mid = (lo + hi) >> 1;
  if (tile_offsets[mid] <= tile) {
    lo = mid;
  } else {
    hi = mid;
  }
}
const int e = lo;
const int bm = tile_rows[e];
const int row0 = row_offsets[e] + (tile - tile_offsets[e]) * bm;
const int row_end = min(row0 + bm, int(row_offsets[e + 1]));
if (bm == 16) {
  qab_grouped_gemm_tile<16, KDIM, NOUT, GLU>(x, w, scales, biases, y, e, row0, row_end, col0,
                                             tid, lane, sgid, xs, ws, cs);
} else if (bm == 32) {
  qab_grouped_gemm_tile<32, KDIM, NOUT, GLU>(x, w, scales, biases, y, e, row0, row_end, col0,
                                             tid, lane, sgid, xs, ws, cs);
} else {
  qab_grouped_gemm_tile<64, KDIM, NOUT, GLU>(x, w, scales, biases, y, e, row0, row_end, col0,
                                             tid, lane, sgid, xs, ws, cs);
}
