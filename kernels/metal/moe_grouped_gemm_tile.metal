// One tile of the grouped 4-bit GEMM (kernels/metal/moe_grouped_gemm.metal):
// BMT rows of expert e (row0 .. row_end - 1, at most BMT of them) x 64 output
// columns from col0 (with GLU also the matching 64 "up" columns), on the
// SIMD-group matrix units (simdgroup_matrix<float, 8, 8>, float32
// accumulation). BMT is the tile height the block map chose for this expert's
// load (16, 32 or 64 rows); same contract as kernels/cuda/moe_grouped_gemm_tile.cuh.
//
// K advances BK = 32 inputs at a time: the x rows are staged in threadgroup
// memory as float (rows past row_end as zeros), the 4-bit weight tile is
// dequantized into threadgroup memory as float (stored [k][n], so both
// operands load as plain row-major 8x8 fragments). Four SIMD groups; SIMD
// group s computes rows (BMT / 2) (s / 2) .. + BMT / 2 - 1 and columns
// 32 (s % 2) .. +31 of the tile as (BMT / 16) x 4 fragments (per weight tile).
//
// xs: >= 64 * (32 + 4) floats; ws: >= 32 * ((GLU ? 2 : 1) * 64 + 4) floats;
// cs: >= 4 * 2 * 64 floats (epilogue scratch, 128 per SIMD group).
template <int BMT, int KDIM, int NOUT, bool GLU, typename XP, typename WP, typename SP,
          typename YP>
void qab_grouped_gemm_tile(XP x, WP w, SP scales, SP biases, YP y, int e, int row0,
                           int row_end, int col0, int tid, int lane, int sgid,
                           threadgroup float* xs, threadgroup float* ws,
                           threadgroup float* cs) {
  constexpr int BN = 64, BK = 32;
  constexpr int NW = GLU ? 2 : 1;            // weight tiles: gate (and up)
  constexpr int R = NW * NOUT;               // weight rows per expert
  constexpr int LDX = BK + 4;                // xs row stride, floats
  constexpr int LDW = NW * BN + 4;           // ws row stride, floats: ws[k][n]
  constexpr int TPR = 128 / (NW * BN);       // threads per weight row: 1 or 2
  constexpr int WPT = (BK / 8) / TPR;        // packed words per thread per K step
  constexpr int FI = BMT / 16;               // 8-row fragments per SIMD group
  static_assert(BMT == 16 || BMT == 32 || BMT == 64, "BMT must be 16, 32 or 64");

  const int sm = (sgid >> 1) * (BMT / 2);  // this SIMD group's first row in the tile
  const int sn = (sgid & 1) * 32;          // and first column (in each weight tile)
  simdgroup_matrix<float, 8, 8> acc[NW][FI][4];
  for (int s = 0; s < NW; ++s) {
    for (int i = 0; i < FI; ++i) {
      for (int j = 0; j < 4; ++j) {
        acc[s][i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      }
    }
  }

  // Each thread's weight row of the tile, wj (gate rows, then up rows: also
  // its column in ws), and which part of each K step's words it dequantizes.
  const int wj = tid / TPR;
  const int wpart = tid - wj * TPR;
  const size_t wrow = size_t(e) * R + (wj / BN) * NOUT + col0 + (wj % BN);

  for (int k0 = 0; k0 < KDIM; k0 += BK) {
    // x tile: BMT rows x 32 values = 8 BMT runs of 4, BMT / 16 per thread.
    for (int i = 0; i < BMT / 16; ++i) {
      const int idx = tid + 128 * i;  // row idx / 8, run idx % 8
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
      simdgroup_matrix<float, 8, 8> a[FI];
      for (int i = 0; i < FI; ++i) {
        simdgroup_load(a[i], xs + (sm + 8 * i) * LDX + kk, LDX);
      }
      for (int s = 0; s < NW; ++s) {
        for (int j = 0; j < 4; ++j) {
          simdgroup_matrix<float, 8, 8> b;
          simdgroup_load(b, ws + kk * LDW + s * BN + sn + 8 * j, LDW);
          for (int i = 0; i < FI; ++i) {
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
  for (int i = 0; i < FI; ++i) {
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
}
