// moe_gate_up_shared_gemv's work for one block: block bx (along x) of token
// row n, of `rows` token rows (the kernel moe_gate_up_shared_gemv.cu, one
// block per (bx, row), and the gate/up phase of moe_decode_block.cu). The
// token's input comes from `xv_of`, a functor giving x[n, k] as float (a row of
// a global array, QabRowLoad, or moe_decode_block.cu's EARLY shared copy);
// with CG, inds are read through L2 (another block of the same launch wrote
// them). `wait` runs after x is staged and before any inds read, in every
// thread of the block (it may hold a block barrier). RPW: (gate, up) row
// pairs per warp (the standalone kernel's QAB_GATE_UP_RPW; the block's GRPW).
// IROW: inds points at row n's K indices (moe_decode_block.cu's GSR items
// route the row themselves into shared memory), else at row 0's.
// Arithmetic, layout and arguments: see moe_gate_up_shared_gemv.cu.
// Needs common.cuh.

constexpr int QAB_GATE_UP_RPW = 2;  // (gate, up) row pairs per warp (standalone kernel)

// x[n, k] of a row-contiguous [N, H] array as float: `row` points at x[n]; with
// CG through L2.
template <typename T, bool CG>
struct QabRowLoad {
  const T* row;
  __device__ __forceinline__ float operator()(const int k) const {
    return static_cast<float>(qab_ld<CG>(row + k));
  }
};
template <bool CG, typename T>
__device__ __forceinline__ QabRowLoad<T, CG> qab_row_load(const T* row) {
  return QabRowLoad<T, CG>{row};
}

template <typename OutT, int H, int I, int K, int G, int SGB, int SGG, bool CG, int RPW,
          bool IROW = false, bool ROLL = false, typename XF, typename QT, typename GQT,
          typename Wait = QabNoWait>
__device__ __forceinline__ void qab_moe_gate_up_shared_part(
    const int bx, const int n, const int rows, const XF xv_of, const uint32_t* inds,
    const uint32_t* w, const QT* scales, const QT* biases, const uint32_t* s_gate_w,
    const QT* s_gate_scales, const QT* s_gate_biases, const uint32_t* s_up_w,
    const QT* s_up_scales, const QT* s_up_biases, const uint32_t* sg_w, const GQT* sg_scales,
    const GQT* sg_biases, OutT* h, float* sg_logit, Wait wait = Wait()) {
  constexpr int NC = H / 32;          // 32-value chunks per row
  constexpr int CPL = H / 1024;       // 32-value chunks per lane
  constexpr int WPR = H / 8;          // uint32 words per 4-bit weight row
  constexpr int GPR = H / G;          // quantization groups per row
  constexpr int KS = K + 1;           // slots: K routed experts, then the shared one
  constexpr int NRW = KS * I / RPW;   // warps of row pairs; warp NRW: the gate logit
  __shared__ float4 xs[8][NC];
  __shared__ float xsum[NC];
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = (bx * blockDim.x + tid) >> 5;

  // x of token n, staged once per block, and each chunk's sum (shared by every row).
  for (int e = tid; e < NC * 8; e += blockDim.x) {
    const int c = e >> 3;
    const int j4 = e & 7;
    const int b = c * 32 + j4 * 4;
    xs[j4][c] = make_float4(xv_of(b), xv_of(b + 1), xv_of(b + 2), xv_of(b + 3));
  }
  __syncthreads();
  for (int c = tid; c < NC; c += blockDim.x) {
    float s = 0.f;
#pragma unroll
    for (int j4 = 0; j4 < 8; ++j4) {
      const float4 v = xs[j4][c];
      s += v.x;
      s += v.y;
      s += v.z;
      s += v.w;
    }
    xsum[c] = s;
  }
  __syncthreads();
  QAB_SUBMARK(5);  // (profiling builds: x staged)
  wait();
  if (warp > NRW) {
    return;
  }

  if (warp == NRW) {
    // The shared expert gate's single row: a 32-value chunk is SGB words.
    constexpr int VPW = 32 / SGB;     // values per word
    constexpr unsigned MASK = (1u << SGB) - 1u;
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < CPL; ++i) {
      const int c = lane + 32 * i;
      float xv[32];
#pragma unroll
      for (int j4 = 0; j4 < 8; ++j4) {
        const float4 v = xs[j4][c];
        xv[4 * j4] = v.x;
        xv[4 * j4 + 1] = v.y;
        xv[4 * j4 + 2] = v.z;
        xv[4 * j4 + 3] = v.w;
      }
      const uint4* src = reinterpret_cast<const uint4*>(sg_w + (size_t)c * SGB);
      float d = 0.f;
#pragma unroll
      for (int v = 0; v < SGB / 4; ++v) {
        const uint4 pk = src[v];
        const uint32_t words[4] = {pk.x, pk.y, pk.z, pk.w};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
#pragma unroll
          for (int b = 0; b < VPW; ++b) {
            d += static_cast<float>((words[q] >> (SGB * b)) & MASK) * xv[(v * 4 + q) * VPW + b];
          }
        }
      }
      const int gi = (c * 32) / SGG;
      acc += static_cast<float>(sg_scales[gi]) * d + static_cast<float>(sg_biases[gi]) * xsum[c];
    }
    acc = qab_warp_sum(acc);
    if (lane == 0) {
      sg_logit[n] = acc;
    } else if (n == 0 && lane < 4 && lane >= rows) {
      sg_logit[lane] = 0.f;  // the 16-byte buffer's elements past N rows (never read)
    }
    return;
  }

  // Every weight, scale and bias load of this warp's row pairs, before any arithmetic.
  uint4 wv[RPW][2][CPL];
  float sc[RPW][2][CPL];
  float bi[RPW][2][CPL];
#pragma unroll
  for (int p = 0; p < RPW; ++p) {
    const int kr = warp * RPW + p;
    const int k = kr / I;
    const int r = kr - k * I;
    const bool is_shared = k == K;
    // Slot K reads the shared expert's own arrays; inds has no column K.
    const uint32_t* ir = IROW ? inds : inds + (size_t)n * K;
    const size_t e = is_shared ? 0 : static_cast<size_t>(qab_ld<CG>(ir + k));
    const size_t gate_row = e * 2 * I + r;
    const size_t up_row = gate_row + I;
    const uint32_t* wg = is_shared ? s_gate_w + (size_t)r * WPR : w + gate_row * WPR;
    const uint32_t* wu = is_shared ? s_up_w + (size_t)r * WPR : w + up_row * WPR;
    auto sgp = is_shared ? s_gate_scales + (size_t)r * GPR : scales + gate_row * GPR;
    auto bgp = is_shared ? s_gate_biases + (size_t)r * GPR : biases + gate_row * GPR;
    auto sup = is_shared ? s_up_scales + (size_t)r * GPR : scales + up_row * GPR;
    auto bup = is_shared ? s_up_biases + (size_t)r * GPR : biases + up_row * GPR;
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const uint4* wrow = reinterpret_cast<const uint4*>(t ? wu : wg);
      auto srow = t ? sup : sgp;
      auto brow = t ? bup : bgp;
#pragma unroll
      for (int i = 0; i < CPL; ++i) {
        const int c = lane + 32 * i;
        wv[p][t][i] = wrow[c];
        sc[p][t][i] = static_cast<float>(srow[(c * 32) / G]);
        bi[p][t][i] = static_cast<float>(brow[(c * 32) / G]);
      }
    }
  }

  float acc[RPW][2];
#pragma unroll
  for (int p = 0; p < RPW; ++p) {
    acc[p][0] = 0.f;
    acc[p][1] = 0.f;
  }
  // Chunk i's gate (t 0) and up (t 1) dots of every row pair p into acc[p],
  // its loads at [p][t][ii] (ii: i unrolled, 0 rolled).
  auto chunk_dot = [&](const int i, const int ii) {
    const int c = lane + 32 * i;
    float xv[32];
#pragma unroll
    for (int j4 = 0; j4 < 8; ++j4) {
      const float4 v = xs[j4][c];
      xv[4 * j4] = v.x;
      xv[4 * j4 + 1] = v.y;
      xv[4 * j4 + 2] = v.z;
      xv[4 * j4 + 3] = v.w;
    }
    const float xs_sum = xsum[c];
    if constexpr (QAB_Q4_PS) {
      qab_q4_prescale32(xv);
    }
#pragma unroll
    for (int p = 0; p < RPW; ++p) {
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        const uint32_t words[4] = {wv[p][t][ii].x, wv[p][t][ii].y, wv[p][t][ii].z,
                                   wv[p][t][ii].w};
        const float d = qab_q4_words_dot<QAB_Q4_PS, false>(words, xv);
        acc[p][t] += sc[p][t][ii] * d + bi[p][t][ii] * xs_sum;
      }
    }
  };
  // (ROLL: one chunk's code, every row pair's, in a loop: common.cuh's
  // qab_dot_loop.)
  qab_dot_loop<CPL, ROLL>(chunk_dot, [&]() { qab_shift_down(wv, sc, bi); });
  QAB_SUBMARK(6);  // (profiling builds: thread 0's dots done, its weights in)

#pragma unroll
  for (int p = 0; p < RPW; ++p) {
    const int kr = warp * RPW + p;
    const int k = kr / I;
    const int r = kr - k * I;
    const float gate = qab_warp_sum(acc[p][0]);
    const float up = qab_warp_sum(acc[p][1]);
    if (lane == 0) {
      const float silu = gate / (1.f + expf(-gate));
      h[((size_t)n * KS + k) * I + r] = static_cast<OutT>(silu * up);
    }
  }
  QAB_SUBMARK(7);  // (profiling builds: thread 0's rows written)
}
