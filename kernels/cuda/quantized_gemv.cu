// Dense 4-bit affine GEMV for decode: y = x W^T for M (a few) rows of x.
//
//   y[m, n] = sum_k x[m, k] * (s[n, k / G] * q[n, k] + b[n, k / G])
//           = sum_chunks (s * sum_j q_j x_j + b * sum_j x_j)
// W is packed 8 nibbles per uint32 (MLX's affine layout: value j of a word at
// bits 4j), w [N, KD / 8]; scales, biases [N, KD / G].
//
// Layout of the work: a row's KD inputs form NC = KD / 32 chunks of 32 values
// (one 16-byte load of packed weights). LPR lanes share a row, each taking
// chunks c = l + LPR * i; a warp works on SUB = 32 / LPR rows at once and on
// RPW such row sets per pass, issuing all RPW * CPL weight loads of a pass
// before any arithmetic (loads in flight are what a GEMV at batch 1 lives on):
// the first pass's before x is staged, each next pass's right after the
// arithmetic of the one before. Warps walk the rows grid-stride, so each block
// stages x only once.
// x is staged in shared memory as float, chunk-transposed
// (xs[m][j / 4][c] holds x[m, 32 c + j .. + 3] as a float4) so that lanes
// reading consecutive chunks hit consecutive 16-byte words (no bank
// conflicts), with each chunk's sum xsum[m][c] beside it.
// A chunk's dot product, its staged inputs and their sum are gemv_q4.cuh's
// (shared with moe_decode_block.cu's out-projection phase: the same bits).
//
// NORM: x is the un-normalised input and the kernel stages its RMSNorm
// instead (a decoder layer's input norm and the projection after it, one
// launch): per row m, inv = rsqrt(sum_k x[m, k]^2 / KD + eps) over the float32
// values of x, and the staged value of x[m, k] is
//   OutT(nw[k] * OutT(x[m, k] * inv))
// with the rounding points of mx.fast.rms_norm (as add_rms_norm.cu; only the
// order of the float32 sum of squares differs). Every block computes the norm
// of its rows itself (KD values each; no cross-block step, so no counter).
//
// PIPE: the passes are double-buffered: each pass's loads are issued before
// the arithmetic of the pass before it (two register sets), so a warp always
// has a pass's loads in flight while it computes. With PIPE the dispatcher
// sizes the grid to about what the GPU holds resident at once (a few blocks
// per SM) and every warp walks several passes; without it each warp issues
// its next pass only after computing the current one (the grid then covers
// the rows in one pass where it can, and the blocks beyond one resident wave
// run as a second wave, staging x and the norm again).
//
// Launch: threadgroup (32 * WARPS, 1, 1), grid (32 * WARPS * blocks, 1, 1).
// Requires KD % 32 == 0, NC % LPR == 0, G % 32 == 0, M * KD * 4 bytes of
// shared memory (the dispatcher keeps it <= 32 KB), WARPS <= 32.
// Inputs: x [M, KD] OutT; w [N, KD / 8] uint32; scales, biases [N, KD / G] ST;
// nw [KD] OutT (NORM; else any one element, not read); eps [4] float32 (NORM: element 0;
// else not read). Output: y [M, N] OutT.

constexpr int NC = KD / 32;       // 32-value chunks per row
constexpr int CPL = NC / LPR;     // chunks per lane
constexpr int SUB = 32 / LPR;     // rows per warp at once
constexpr int WPR = KD / 8;       // uint32 words per row
constexpr int GPR = KD / G;       // quantization groups per row
constexpr int ROWS_PER_WARP = SUB * RPW;

__shared__ float4 xs[M][8][NC];
__shared__ float xsum[M][NC];
__shared__ float red[M][32];
__shared__ float xinv[M];

const int tid = threadIdx.x;
const int lane = tid & 31;
const int sub = lane / LPR;
const int sl = lane - sub * LPR;
const int warps = blockDim.x >> 5;
const int gwarp = blockIdx.x * warps + (tid >> 5);
const int nwarps = gridDim.x * warps;

// Every weight, scale and bias load of a pass is issued before its
// arithmetic; the first pass's before x is staged (they do not depend on it),
// so their trip to memory overlaps the staging (and the norm).
uint4 wv[RPW][CPL];
float sc[RPW][CPL];
float bi[RPW][CPL];
// The second register set (PIPE only; a single unused element otherwise).
constexpr int RPW2 = PIPE ? RPW : 1;
constexpr int CPL2 = PIPE ? CPL : 1;
uint4 wv2[RPW2][CPL2];
float sc2[RPW2][CPL2];
float bi2[RPW2][CPL2];
auto load_into = [&](auto& wv, auto& sc, auto& bi, int base) {
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    const int row = base + r * SUB + sub;
    const bool ok = row < N;
    const uint4* wrow = reinterpret_cast<const uint4*>(w + (size_t)(ok ? row : 0) * WPR);
#pragma unroll
    for (int i = 0; i < CPL; ++i) {
      const int c = sl + LPR * i;
      wv[r][i] = ok ? wrow[c] : make_uint4(0u, 0u, 0u, 0u);
      const size_t gi = (size_t)(ok ? row : 0) * GPR + (c * 32) / G;
      sc[r][i] = ok ? static_cast<float>(scales[gi]) : 0.f;
      bi[r][i] = ok ? static_cast<float>(biases[gi]) : 0.f;
    }
  }
};
load_into(wv, sc, bi, gwarp * ROWS_PER_WARP);

if constexpr (NORM) {
  // Each row's sum of squares: per thread, a warp butterfly, one partial per
  // warp, then thread m adds row m's partials in warp order.
  for (int m = 0; m < M; ++m) {
    float ss = 0.f;
    for (int k = tid; k < KD; k += blockDim.x) {
      const float v = static_cast<float>(x[(size_t)m * KD + k]);
      ss += v * v;
    }
    ss = qab_warp_sum(ss);
    if ((tid & 31) == 0) {
      red[m][tid >> 5] = ss;
    }
  }
  __syncthreads();
  if (tid < M) {
    float total = 0.f;
    for (int wi = 0; wi < (int)(blockDim.x >> 5); ++wi) {
      total += red[tid][wi];
    }
    xinv[tid] = rsqrtf(total / static_cast<float>(KD) + eps[0]);
  }
  __syncthreads();
}
for (int i = tid; i < M * NC * 8; i += blockDim.x) {
  const int m = i / (NC * 8);
  const int r = i - m * NC * 8;
  const int c = r >> 3;
  const int j4 = r & 7;
  const int k0 = c * 32 + j4 * 4;
  const size_t base = (size_t)m * KD + k0;
  float v[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    v[e] = static_cast<float>(x[base + e]);
    if constexpr (NORM) {
      const float nv = static_cast<float>(static_cast<OutT>(v[e] * xinv[m]));
      v[e] = static_cast<float>(static_cast<OutT>(static_cast<float>(nw[k0 + e]) * nv));
    }
  }
  xs[m][j4][c] = make_float4(v[0], v[1], v[2], v[3]);
}
__syncthreads();
for (int i = tid; i < M * NC; i += blockDim.x) {
  const int m = i / NC;
  const int c = i - m * NC;
  xsum[m][c] = qab_q4_chunk_sum<NC>(xs[m], c);
}
__syncthreads();

const int stride = nwarps * ROWS_PER_WARP;
// One pass: rows base + r * SUB + sub (r < RPW) from the register set given.
auto compute_pass = [&](const auto& wv, const auto& sc, const auto& bi, int base) {
  float acc[M][RPW];
#pragma unroll
  for (int m = 0; m < M; ++m) {
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      acc[m][r] = 0.f;
    }
  }

#pragma unroll
  for (int i = 0; i < CPL; ++i) {
    const int c = sl + LPR * i;
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float xv[32];
      qab_q4_chunk_x<NC>(xs[m], c, xv);
      const float xs_sum = xsum[m][c];
#pragma unroll
      for (int r = 0; r < RPW; ++r) {
        acc[m][r] = fmaf(sc[r][i], qab_q4_dot32(wv[r][i], xv), fmaf(bi[r][i], xs_sum, acc[m][r]));
      }
    }
  }

#pragma unroll
  for (int m = 0; m < M; ++m) {
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      const float v = qab_group_sum<LPR>(acc[m][r]);
      const int row = base + r * SUB + sub;
      if (sl == 0 && row < N) {
        y[(size_t)m * N + row] = static_cast<OutT>(v);
      }
    }
  }
};

if constexpr (PIPE) {
  // The next pass's loads go out into set 2 before this pass's arithmetic;
  // set 2 then moves into set 1 (register moves, which wait for those loads:
  // the arithmetic that needs them comes next anyway).
  for (int base = gwarp * ROWS_PER_WARP; base < N; base += stride) {
    const bool more = base + stride < N;
    if (more) {
      load_into(wv2, sc2, bi2, base + stride);
    }
    compute_pass(wv, sc, bi, base);
    if (more) {
#pragma unroll
      for (int r = 0; r < RPW; ++r) {
#pragma unroll
        for (int i = 0; i < CPL; ++i) {
          wv[r][i] = wv2[r][i];
          sc[r][i] = sc2[r][i];
          bi[r][i] = bi2[r][i];
        }
      }
    }
  }
} else {
  for (int base = gwarp * ROWS_PER_WARP; base < N; base += stride) {
    compute_pass(wv, sc, bi, base);
    if (base + stride < N) {
      load_into(wv, sc, bi, base + stride);  // the next pass's loads
    }
  }
}
