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
// Tiles as in the CUDA kernel: a threadgroup owns BM = 64 rows of one expert
// and BN = 64 output columns (with GLU also the matching 64 "up" columns);
// tile_offsets[e] is the first tile of expert e, found by binary search;
// threadgroups past the last tile return; rows at or past the expert's last
// row are read as zeros and never written. K advances BK = 32 inputs at a
// time: the x tile is staged in threadgroup memory as float, the 4-bit weight
// tile is dequantized into threadgroup memory as float (stored [k][n], so both
// operands load as plain row-major 8x8 fragments). Four SIMD groups; SIMD
// group s computes rows 32 (s / 2) .. +31 and columns 32 (s % 2) .. +31 of the
// tile as 4 x 4 fragments (per weight tile). Threadgroup memory: 27.5 KB with
// GLU, 19.5 KB without (the limit is 32 KB).
//
// Launch: grid (128 * n_tiles_max, NOUT / 64, 1) threads, threadgroup (128, 1, 1),
// n_tiles_max = M / 64 + E (an upper bound on sum_e ceil(rows_e / 64)).
// Inputs: x [M, KDIM] bf16; w [E, R, KDIM/8] uint32 (R = 2 NOUT with GLU, else
// NOUT; 8 nibbles per word, low nibble first); scales, biases [E, R, KDIM/64]
// bf16; row_offsets, tile_offsets [E + 1] int32. Output: y [M, NOUT] bf16.
// Requires KDIM % 64 == 0 and NOUT % 64 == 0.

constexpr int BM = 64, BN = 64, BK = 32;
constexpr int NW = GLU ? 2 : 1;            // weight tiles: gate (and up)
constexpr int R = NW * NOUT;               // weight rows per expert
constexpr int LDX = BK + 4;                // xs row stride, floats
constexpr int LDW = NW * BN + 4;           // ws row stride, floats: ws[k][n]
constexpr int TPR = 128 / (NW * BN);       // threads per weight row: 1 or 2
constexpr int WPT = (BK / 8) / TPR;        // packed words per thread per K step
static_assert(KDIM % 64 == 0 && NOUT % BN == 0, "KDIM and NOUT must be multiples of 64");
threadgroup float xs[BM * LDX];
threadgroup float ws[BK * LDW];
threadgroup float cs[4 * 2 * 64];          // epilogue: one gate (+ up) 8x8 fragment per SIMD group

const int tid = int(thread_index_in_threadgroup);
const int lane = int(thread_index_in_simdgroup);
const int sgid = int(simdgroup_index_in_threadgroup);
const int tile = int(threadgroup_position_in_grid.x);
const int col0 = int(threadgroup_position_in_grid.y) * BN;
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
const int row0 = row_offsets[e] + (tile - tile_offsets[e]) * BM;
const int row_end = min(row0 + BM, int(row_offsets[e + 1]));

const int sm = (sgid >> 1) * 32;  // this SIMD group's first row in the tile
const int sn = (sgid & 1) * 32;   // and first column (in each weight tile)
simdgroup_matrix<float, 8, 8> acc[NW][4][4];
for (int s = 0; s < NW; ++s) {
  for (int i = 0; i < 4; ++i) {
    for (int j = 0; j < 4; ++j) {
      acc[s][i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    }
  }
}

// Each thread's weight row of the tile, wj (gate rows, then up rows: also its
// column in ws), and which part of each K step's words it dequantizes.
const int wj = tid / TPR;
const int wpart = tid - wj * TPR;
const size_t wrow = size_t(e) * R + (wj / BN) * NOUT + col0 + (wj % BN);

for (int k0 = 0; k0 < KDIM; k0 += BK) {
  // x tile: 64 rows x 32 values; each thread converts 4 runs of 4.
  for (int i = 0; i < 4; ++i) {
    const int idx = tid + 128 * i;  // 0..511: row idx / 8, run idx % 8
    const int r = idx >> 3;
    const int c = (idx & 7) * 4;
    threadgroup float* dst = xs + r * LDX + c;
    if (row0 + r < row_end) {
      const size_t src = size_t(row0 + r) * KDIM + k0 + c;
      for (int q = 0; q < 4; ++q) {
        dst[q] = static_cast<float>(x[src + q]);
      }
    } else {
      for (int q = 0; q < 4; ++q) {
        dst[q] = 0.0f;
      }
    }
  }
  // Weight tile: NW * 64 rows x 32 nibbles, dequantized to ws[k][n].
  {
    const float sc = static_cast<float>(scales[wrow * (KDIM / 64) + k0 / 64]);
    const float bi = static_cast<float>(biases[wrow * (KDIM / 64) + k0 / 64]);
    for (int q = 0; q < WPT; ++q) {
      const int word = wpart * WPT + q;  // 0..3 within this K step
      const uint pk = w[wrow * (KDIM / 8) + k0 / 8 + word];
      for (int b = 0; b < 8; ++b) {
        ws[(word * 8 + b) * LDW + wj] = sc * float((pk >> (4 * b)) & 15u) + bi;
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int kk = 0; kk < BK; kk += 8) {
    simdgroup_matrix<float, 8, 8> a[4];
    for (int i = 0; i < 4; ++i) {
      simdgroup_load(a[i], xs + (sm + 8 * i) * LDX + kk, LDX);
    }
    for (int s = 0; s < NW; ++s) {
      for (int j = 0; j < 4; ++j) {
        simdgroup_matrix<float, 8, 8> b;
        simdgroup_load(b, ws + kk * LDW + s * BN + sn + 8 * j, LDW);
        for (int i = 0; i < 4; ++i) {
          simdgroup_multiply_accumulate(acc[s][i][j], a[i], b, acc[s][i][j]);
        }
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// Epilogue, one 8x8 fragment (pair) at a time through this SIMD group's own
// scratch: lane l finishes elements 2l and 2l + 1 (row (2l) / 8 of the fragment).
threadgroup float* cg = cs + sgid * 128;
for (int i = 0; i < 4; ++i) {
  for (int j = 0; j < 4; ++j) {
    simdgroup_store(acc[0][i][j], cg, 8);
    if (GLU) {
      simdgroup_store(acc[NW - 1][i][j], cg + 64, 8);
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);
    for (int h = 0; h < 2; ++h) {
      const int el = 2 * lane + h;
      const int row = row0 + sm + 8 * i + (el >> 3);
      const int col = col0 + sn + 8 * j + (el & 7);
      if (row < row_end) {
        float v = cg[el];
        if (GLU) {
          v = v / (1.0f + metal::exp(-v)) * cg[64 + el];
        }
        y[size_t(row) * NOUT + col] = static_cast<bfloat16_t>(v);
      }
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);
  }
}
