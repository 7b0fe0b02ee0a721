// One tile of the grouped 4-bit GEMM (kernels/cuda/moe_grouped_gemm.cu): BMT
// rows of expert e (row0 .. row_end - 1, at most BMT of them) x 64 output
// columns from col0 (with GLU also the matching 64 "up" columns), on the bf16
// tensor cores (mma.sync m16n8k16, float32 accumulation). BMT is the tile
// height the block map chose for this expert's load (16, 32 or 64 rows).
//
// Four warps. With BMT = 64 each warp owns 16 rows x all 64 columns; with
// fewer rows the warps split the columns instead, so no warp multiplies rows
// the tile does not have: BMT = 32 -> 2 x 2 warps of 16 rows x 32 columns,
// BMT = 16 -> 1 x 4 warps of 16 rows x 16 columns. Each 64-wide K step stages
// the x rows (bf16, 16-byte loads, rows past row_end as zeros) and the
// dequantized weight tile (same for every BMT) in shared memory.
//
// xs: >= 64 * 72 bf16, ws: >= (GLU ? 2 : 1) * 64 * 72 bf16, both 16-byte aligned.
template <int BMT, int KDIM, int NOUT, bool GLU, typename XP, typename WP, typename SP,
          typename YP>
__device__ __forceinline__ void qab_grouped_gemm_tile(XP x, WP w, SP scales, SP biases, YP y,
                                                      int e, int row0, int row_end, int col0,
                                                      __nv_bfloat16* xs, __nv_bfloat16* ws) {
  constexpr int BN = 64, BK = 64, LDS = BK + 8;  // +8: no bank conflicts
  constexpr int S = GLU ? 2 : 1;                 // weight tiles: gate (and up)
  constexpr int R = S * NOUT;                    // weight rows per expert
  constexpr int WM = BMT / 16;                   // warps along rows
  constexpr int WN = 4 / WM;                     // warps along columns
  constexpr int NB = BN / (8 * WN);              // 8-column mma blocks per warp
  static_assert(BMT == 16 || BMT == 32 || BMT == 64, "BMT must be 16, 32 or 64");

  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5;
  const int wr = warp / WN, wc = warp % WN;  // this warp's row and column block
  const int g = lane >> 2, t4 = lane & 3;
  float acc[S][NB][4];
#pragma unroll
  for (int s = 0; s < S; ++s)
#pragma unroll
    for (int j = 0; j < NB; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[s][j][q] = 0.f;

  for (int k0 = 0; k0 < KDIM; k0 += BK) {
    // x tile: BMT rows x 64 bf16 = 8 BMT 16-byte chunks, BMT / 16 per thread.
#pragma unroll
    for (int i = 0; i < BMT / 16; ++i) {
      const int idx = tid + 128 * i;  // row idx / 8, 8-wide chunk idx % 8
      const int r = idx >> 3, ch = idx & 7;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (row0 + r < row_end) {
        v = *reinterpret_cast<const uint4*>(x + (size_t)(row0 + r) * KDIM + k0 + ch * 8);
      }
      *reinterpret_cast<uint4*>(xs + r * LDS + ch * 8) = v;
    }
    // Weight tiles: 64 (or 128) rows x 64 nibbles; each thread dequantizes 32.
#pragma unroll
    for (int s = 0; s < S; ++s) {
      const int n = tid >> 1, half = tid & 1;
      const size_t wrow = (size_t)e * R + (s ? NOUT : 0) + col0 + n;
      const uint4 pk =
          *reinterpret_cast<const uint4*>(w + wrow * (KDIM / 8) + k0 / 8 + half * 4);
      const float sc = static_cast<float>(scales[wrow * (KDIM / 64) + k0 / 64]);
      const float bi = static_cast<float>(biases[wrow * (KDIM / 64) + k0 / 64]);
      const uint32_t words[4] = {pk.x, pk.y, pk.z, pk.w};
      __nv_bfloat16* dst = ws + (s * BN + n) * LDS + half * 32;
#pragma unroll
      for (int q = 0; q < 4; ++q) {
#pragma unroll
        for (int b = 0; b < 8; b += 2) {
          const float v0 = sc * static_cast<float>((words[q] >> (4 * b)) & 15u) + bi;
          const float v1 = sc * static_cast<float>((words[q] >> (4 * b + 4)) & 15u) + bi;
          *reinterpret_cast<__nv_bfloat162*>(dst + q * 8 + b) = __floats2bfloat162_rn(v0, v1);
        }
      }
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      const __nv_bfloat16* xa = xs + (wr * 16) * LDS + kk + t4 * 2;
      const uint32_t a0 = *reinterpret_cast<const uint32_t*>(xa + g * LDS);
      const uint32_t a1 = *reinterpret_cast<const uint32_t*>(xa + (g + 8) * LDS);
      const uint32_t a2 = *reinterpret_cast<const uint32_t*>(xa + g * LDS + 8);
      const uint32_t a3 = *reinterpret_cast<const uint32_t*>(xa + (g + 8) * LDS + 8);
#pragma unroll
      for (int s = 0; s < S; ++s) {
#pragma unroll
        for (int j = 0; j < NB; ++j) {
          const __nv_bfloat16* wb = ws + (s * BN + (wc * NB + j) * 8 + g) * LDS + kk + t4 * 2;
          const uint32_t b0 = *reinterpret_cast<const uint32_t*>(wb);
          const uint32_t b1 = *reinterpret_cast<const uint32_t*>(wb + 8);
          float* c = acc[s][j];
          asm volatile(
              "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
              "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
              : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
              : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
        }
      }
    }
    __syncthreads();
  }

  // Epilogue: c0,c1 at (row g, cols 2 t4, 2 t4 + 1), c2,c3 at row g + 8.
#pragma unroll
  for (int j = 0; j < NB; ++j) {
    const int col = col0 + (wc * NB + j) * 8 + t4 * 2;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row0 + wr * 16 + g + 8 * h;
      if (row < row_end) {
        float v0 = acc[0][j][2 * h], v1 = acc[0][j][2 * h + 1];
        if (GLU) {
          v0 = v0 / (1.f + expf(-v0)) * acc[S - 1][j][2 * h];
          v1 = v1 / (1.f + expf(-v1)) * acc[S - 1][j][2 * h + 1];
        }
        *reinterpret_cast<__nv_bfloat162*>(y + (size_t)row * NOUT + col) =
            __floats2bfloat162_rn(v0, v1);
      }
    }
  }
}
