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
// Tiles: a block owns BM = 64 rows of one expert and BN = 64 output columns
// (and, with GLU, the matching 64 "up" columns). tile_offsets[e] is the first
// tile of expert e (exclusive scan of ceil(rows_e / BM)); a block finds its
// expert by binary search, so the launch needs no host sync: blocks past the
// last tile exit. Four warps; warp w computes rows 16w..16w+15 of the tile.
//
// Launch: grid (128 * n_tiles_max, NOUT / 64, 1) threads, threadgroup (128, 1, 1),
// n_tiles_max = M / 64 + E (an upper bound on sum_e ceil(rows_e / 64)).
// Inputs: x [M, KDIM] bf16; w [E, R, KDIM/8] uint32 (R = 2 NOUT with GLU, else
// NOUT); scales, biases [E, R, KDIM/64] bf16; row_offsets, tile_offsets
// [E + 1] int32. Output: y [M, NOUT] bf16.

constexpr int BM = 64, BN = 64, BK = 64, LDS = BK + 8;  // +8: no bank conflicts
constexpr int R = GLU ? 2 * NOUT : NOUT;
__shared__ __align__(16) __nv_bfloat16 xs[BM * LDS];
__shared__ __align__(16) __nv_bfloat16 ws[(GLU ? 2 : 1) * BN * LDS];

const int tid = threadIdx.x;
const int lane = tid & 31, warp = tid >> 5;
const int tile = blockIdx.x;
const int col0 = blockIdx.y * BN;
if (tile >= tile_offsets[E]) {
  return;
}
int lo = 0, hi = E;  // tile_offsets[lo] <= tile < tile_offsets[hi]
while (hi - lo > 1) {
  const int mid = (lo + hi) >> 1;
  if (tile_offsets[mid] <= tile) lo = mid; else hi = mid;
}
const int e = lo;
const int row0 = row_offsets[e] + (tile - tile_offsets[e]) * BM;
const int row_end = min(row0 + BM, row_offsets[e + 1]);

const int g = lane >> 2, t4 = lane & 3;
float acc[GLU ? 2 : 1][8][4];
#pragma unroll
for (int s = 0; s < (GLU ? 2 : 1); ++s)
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int q = 0; q < 4; ++q) acc[s][j][q] = 0.f;

for (int k0 = 0; k0 < KDIM; k0 += BK) {
  // x tile: 64 rows x 64 bf16; each thread copies 4 x 8 bf16 (16 bytes each).
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int idx = tid + 128 * i;   // 0..511: row = idx / 8, 8-wide chunk = idx % 8
    const int r = idx >> 3, ch = idx & 7;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (row0 + r < row_end) {
      v = *reinterpret_cast<const uint4*>(x + (size_t)(row0 + r) * KDIM + k0 + ch * 8);
    }
    *reinterpret_cast<uint4*>(xs + r * LDS + ch * 8) = v;
  }
  // weight tiles: 64 (or 128) rows x 64 nibbles; each thread dequantizes 32.
#pragma unroll
  for (int s = 0; s < (GLU ? 2 : 1); ++s) {
    const int n = tid >> 1, half = tid & 1;
    const size_t wrow = (size_t)e * R + (s ? NOUT : 0) + col0 + n;
    const uint4 pk = *reinterpret_cast<const uint4*>(w + wrow * (KDIM / 8) + k0 / 8 + half * 4);
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
    const __nv_bfloat16* xa = xs + (warp * 16) * LDS + kk + t4 * 2;
    const uint32_t a0 = *reinterpret_cast<const uint32_t*>(xa + g * LDS);
    const uint32_t a1 = *reinterpret_cast<const uint32_t*>(xa + (g + 8) * LDS);
    const uint32_t a2 = *reinterpret_cast<const uint32_t*>(xa + g * LDS + 8);
    const uint32_t a3 = *reinterpret_cast<const uint32_t*>(xa + (g + 8) * LDS + 8);
#pragma unroll
    for (int s = 0; s < (GLU ? 2 : 1); ++s) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const __nv_bfloat16* wb = ws + (s * BN + j * 8 + g) * LDS + kk + t4 * 2;
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
for (int j = 0; j < 8; ++j) {
  const int col = col0 + j * 8 + t4 * 2;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row0 + warp * 16 + g + 8 * h;
    if (row < row_end) {
      float v0 = acc[0][j][2 * h], v1 = acc[0][j][2 * h + 1];
      if (GLU) {
        v0 = v0 / (1.f + expf(-v0)) * acc[GLU ? 1 : 0][j][2 * h];
        v1 = v1 / (1.f + expf(-v1)) * acc[GLU ? 1 : 0][j][2 * h + 1];
      }
      *reinterpret_cast<__nv_bfloat162*>(y + (size_t)row * NOUT + col) =
          __floats2bfloat162_rn(v0, v1);
    }
  }
}
