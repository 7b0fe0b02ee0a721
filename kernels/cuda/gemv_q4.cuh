// Dense 4-bit affine GEMV pieces shared by quantized_gemv.cu and the
// out-projection phase of moe_decode_block.cu (OP), so both compute a row
// with the same arithmetic in the same order, hence the same bits.
// Needs common.cuh.

// One 32-value chunk of a row: 32 packed 4-bit weights (a 16-byte uint4,
// value j of a word at bits 4j, MLX's affine layout) dotted with the 32
// staged float inputs xv, in the order (word q, value b) = (0, 0), (0, 1),
// ... Nibbles become floats with the 2^23 trick (qab_nibble_mantissa): two
// integer ops and one add instead of a conversion. PS (QAB_Q4_PRESCALE
// builds): xv holds x[k] times qab_q4_prescale of its place, so each nibble
// is masked in place (qab_nibble_placed, common.cuh): the same products.
template <bool PS = false>
__device__ __forceinline__ float qab_q4_dot32(const uint4 wv, const float (&xv)[32]) {
  const uint32_t words[4] = {wv.x, wv.y, wv.z, wv.w};
  return qab_q4_words_dot<PS, true>(words, xv);
}

// The 32 staged inputs of chunk c from the chunk-transposed staging
// xs[j4][c] (x[32 c + 4 j4 .. + 3] as a float4).
template <int NC>
__device__ __forceinline__ void qab_q4_chunk_x(const float4 (&xs)[8][NC], const int c,
                                               float (&xv)[32]) {
#pragma unroll
  for (int j4 = 0; j4 < 8; ++j4) {
    const float4 v = xs[j4][c];
    xv[4 * j4] = v.x;
    xv[4 * j4 + 1] = v.y;
    xv[4 * j4 + 2] = v.z;
    xv[4 * j4 + 3] = v.w;
  }
}

// A chunk's input sum, the bias term's factor, in quantized_gemv.cu's order.
// PS: xs holds prescaled values (qab_q4_dot32), unscaled here exactly.
template <int NC, bool PS = false>
__device__ __forceinline__ float qab_q4_chunk_sum(const float4 (&xs)[8][NC], const int c) {
  float s = 0.f;
#pragma unroll
  for (int j4 = 0; j4 < 8; ++j4) {
    float4 v = xs[j4][c];
    if constexpr (PS) {
      const int b = (j4 & 1) * 4;
      v = make_float4(v.x / qab_q4_prescale(b), v.y / qab_q4_prescale(b + 1),
                      v.z / qab_q4_prescale(b + 2), v.w / qab_q4_prescale(b + 3));
    }
    s += (v.x + v.y) + (v.z + v.w);
  }
  return s;
}

// Stages x (KD = 32 NC values from `xv_of`, a functor giving x[k] as float)
// chunk-transposed into xs[j4][c] (x[32 c + 4 j4 .. + 3] as a float4), element
// e = c * 8 + j4 by thread e % threads. NT: the block's threads when known at
// compile time and dividing 8 NC (the loop is unrolled: a thread's reads go
// out together), else 0 (blockDim.x, a loop). The same values either way.
template <int NC, int NT, bool PS = false, typename XF>
__device__ __forceinline__ void qab_q4_stage_x(float4 (&xs)[8][NC], const XF xv_of) {
  const int tid = threadIdx.x;
  auto one = [&](const int e) {
    const int c = e >> 3;
    const int j4 = e & 7;
    const int k0 = c * 32 + j4 * 4;
    if constexpr (PS) {
      const int b = (j4 & 1) * 4;
      xs[j4][c] = make_float4(xv_of(k0) * qab_q4_prescale(b),
                              xv_of(k0 + 1) * qab_q4_prescale(b + 1),
                              xv_of(k0 + 2) * qab_q4_prescale(b + 2),
                              xv_of(k0 + 3) * qab_q4_prescale(b + 3));
    } else {
      xs[j4][c] = make_float4(xv_of(k0), xv_of(k0 + 1), xv_of(k0 + 2), xv_of(k0 + 3));
    }
  };
  if constexpr (NT > 0 && (NC * 8) % NT == 0) {
#pragma unroll
    for (int j = 0; j < NC * 8 / NT; ++j) {
      one(tid + j * NT);
    }
  } else {
    for (int e = tid; e < NC * 8; e += blockDim.x) {
      one(e);
    }
  }
}

// qab_q4_stage_x, a block barrier, then each chunk's input sum into xsum[c]
// (qab_q4_chunk_sum); the caller meets at a barrier before reading xsum.
template <int NC, int NT, bool PS = false, typename XF>
__device__ __forceinline__ void qab_q4_stage_x_sums(float4 (&xs)[8][NC], float* xsum,
                                                    const XF xv_of) {
  qab_q4_stage_x<NC, NT, PS>(xs, xv_of);
  __syncthreads();
  const int tid = threadIdx.x;
  if constexpr (NT > 0) {
    for (int c = tid; c < NC; c += NT) {
      xsum[c] = qab_q4_chunk_sum<NC, PS>(xs, c);
    }
  } else {
    for (int c = tid; c < NC; c += blockDim.x) {
      xsum[c] = qab_q4_chunk_sum<NC, PS>(xs, c);
    }
  }
}

// One thread block's share of y = x W^T for ONE token row, rows
// [row0, row0 + (BLOCK / 32) RPW) of the NOUT outputs (rows past NOUT are
// skipped), as quantized_gemv.cu computes them with M = 1, LPR = 32 (a warp's
// 32 lanes share a row, lane l taking chunks l, l + 32, ...), RPW rows per
// warp and one pass: the same bits. The block's weight loads are issued
// first, then it stages x (KD values, read through `xv_of`, a functor giving
// x[k] as float) in the caller's shared memory: `stage`, at least 8 KD / 32
// float4, and `stage_sum`, at least KD / 32 floats (one buffer a kernel may
// share between calls of several widths). `wait` runs between the two in every
// thread (it may hold a block barrier: moe_decode_block.cu's next-projection
// items wait there for the row they read). Every thread of the block must
// call it (it holds block barriers). Requires KD % 1024 == 0, G % 32 == 0.
// w [NOUT, KD / 8] uint32; scales, biases [NOUT, KD / G] ST; y: the token
// row's NOUT outputs. NT: the block's threads when known at compile time (0:
// blockDim.x): the staging loop is then unrolled, so that a thread's reads of
// x (through L2 where another block wrote it: moe_decode_block.cu) go out
// together instead of one round trip per iteration; the same values.
// stage_input false: `stage` and `stage_sum` already hold this x (the block
// staged it for an earlier call with the same x and has not written them
// since: moe_decode_block.cu's NPL), so neither `wait` nor the staging runs.
template <typename OutT, typename ST, int KD, int G, int RPW, int NT = 0, bool ROLL = false,
          typename XF, typename Wait = QabNoWait>
__device__ __forceinline__ void qab_q4_gemv_rows(const int row0, const int nout, const XF xv_of,
                                                 const uint32_t* w, const ST* scales,
                                                 const ST* biases, OutT* y, float4* stage,
                                                 float* stage_sum, Wait wait = Wait(),
                                                 const bool stage_input = true) {
  static_assert(KD % 1024 == 0 && G % 32 == 0, "qab_q4_gemv_rows: KD % 1024, G % 32");
  constexpr int NC = KD / 32;   // 32-value chunks per row
  constexpr int CPL = NC / 32;  // chunks per lane
  constexpr int WPR = KD / 8;   // uint32 words per row
  constexpr int GPR = KD / G;   // quantization groups per row
  auto& xs = *reinterpret_cast<float4(*)[8][NC]>(stage);
  float* xsum = stage_sum;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int base = row0 + (tid >> 5) * RPW;

  uint4 wv[RPW][CPL];
  float sc[RPW][CPL];
  float bi[RPW][CPL];
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    const int row = base + r;
    const bool ok = row < nout;
    const uint4* wrow = reinterpret_cast<const uint4*>(w + (size_t)(ok ? row : 0) * WPR);
#pragma unroll
    for (int i = 0; i < CPL; ++i) {
      const int c = lane + 32 * i;
      wv[r][i] = ok ? wrow[c] : make_uint4(0u, 0u, 0u, 0u);
      const size_t gi = (size_t)(ok ? row : 0) * GPR + (c * 32) / G;
      sc[r][i] = ok ? static_cast<float>(scales[gi]) : 0.f;
      bi[r][i] = ok ? static_cast<float>(biases[gi]) : 0.f;
    }
  }
  if constexpr (!QabIsNoWait<Wait>::value) {
    qab_pin_loads(wv, sc, bi);  // (profiling builds with QAB_PIN_LOADS only)
  }
  if (stage_input) {
    wait();
    qab_q4_stage_x_sums<NC, NT, QAB_Q4_PS>(xs, xsum, xv_of);
    __syncthreads();
    QAB_SUBMARK(5);  // (profiling builds: the input staged)
  }
  float acc[RPW];
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    acc[r] = 0.f;
  }
  // Chunk i's dots, its loads at index ii of wv, sc, bi (ii == i, or 0 rolled).
  auto chunk_dot = [&](const int i, const int ii) {
    const int c = lane + 32 * i;
    float xv[32];
    qab_q4_chunk_x<NC>(xs, c, xv);
    const float s = xsum[c];
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      acc[r] = fmaf(sc[r][ii], qab_q4_dot32<QAB_Q4_PS>(wv[r][ii], xv), fmaf(bi[r][ii], s, acc[r]));
    }
  };
  qab_dot_loop<CPL, ROLL>(chunk_dot, [&]() { qab_shift_down(wv, sc, bi); });
  QAB_SUBMARK(6);  // (profiling builds: thread 0's dots done, its weights in)
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    const float v = qab_warp_sum(acc[r]);
    if (lane == 0 && base + r < nout) {
      y[base + r] = static_cast<OutT>(v);
    }
  }
  QAB_SUBMARK(7);  // (profiling builds: thread 0's rows written)
}

// quantized_gemv.cu's NORM factor for one row (its M loop at M = 1):
// inv = rsqrt(sum_k x[k]^2 / KD + eps) with the sum in its order: per thread
// over k = tid, tid + blockDim.x, ..., a warp butterfly, then the warps'
// partials added in warp order. x[k] comes from `xv_of` (a functor giving it
// as float). Every thread of the block must call it (block barriers); every
// thread gets inv. NT: the block's threads when known at compile time (the
// loop unrolled, its reads out together; the same sum), else 0.
template <int KD, int NT = 0, typename XF>
__device__ __forceinline__ float qab_q4_row_norm_inv(const XF xv_of, const float eps) {
  __shared__ float red[32];
  __shared__ float inv_s;
  const int tid = threadIdx.x;
  float ss = 0.f;
  if constexpr (NT > 0 && KD % NT == 0) {
    float v[KD / NT];
#pragma unroll
    for (int j = 0; j < KD / NT; ++j) {
      v[j] = xv_of(tid + j * NT);
    }
#pragma unroll
    for (int j = 0; j < KD / NT; ++j) {
      ss += v[j] * v[j];
    }
  } else {
    for (int k = tid; k < KD; k += blockDim.x) {
      const float v = xv_of(k);
      ss += v * v;
    }
  }
  ss = qab_warp_sum(ss);
  if ((tid & 31) == 0) {
    red[tid >> 5] = ss;
  }
  __syncthreads();
  if (tid == 0) {
    float total = 0.f;
    for (int wi = 0; wi < (int)(blockDim.x >> 5); ++wi) {
      total += red[wi];
    }
    inv_s = rsqrtf(total / static_cast<float>(KD) + eps);
  }
  __syncthreads();
  return inv_s;
}

// The shared-memory layout of ROWS staged rows of a 4-bit [nout, KD]
// projection (qab_q4_rows_stage_issue writes it, qab_q4_gemv_rows_staged
// reads it): the weights [ROWS][KD / 32] uint4 at wsm, then the scales and
// the biases, [ROWS][KD / G] ST each.
template <typename ST, int KD, int G, int ROWS>
struct QabQ4RowsSmem {
  uint4* w;
  ST* s;
  ST* b;
  __device__ __forceinline__ explicit QabQ4RowsSmem(uint4* wsm)
      : w(wsm), s(reinterpret_cast<ST*>(wsm + (size_t)ROWS * (KD / 32))),
        b(s + (size_t)ROWS * (KD / G)) {}
};

// The first half of qab_q4_gemv_rows_staged: copies rows [row0, row0 + ROWS)
// of a 4-bit [nout, KD] projection (rows past nout skipped), their weights,
// scales and biases, into `wsm` (the layout qab_q4_gemv_rows_staged reads) by
// cp.async, and commits them as one group. A caller may issue it long before
// the rows are used (moe_decode_block.cu's NPS: at the block's start), then
// call qab_q4_gemv_rows_staged with issue false; the group is complete at that
// call's cp.async wait, or at any earlier cp.async wait of the thread (which
// waits for every group in flight). Scales and biases that are not 16-byte
// aligned rows are copied by plain loads here, at once. Every thread of the
// block must call it.
template <typename ST, int KD, int G, int ROWS, int BLOCK>
__device__ __forceinline__ void qab_q4_rows_stage_issue(const int row0, const int nout,
                                                        const uint32_t* w, const ST* scales,
                                                        const ST* biases, uint4* wsm) {
  constexpr int NC = KD / 32;
  constexpr int GPR = KD / G;
  constexpr bool SB16 = (GPR * sizeof(ST)) % 16 == 0;
  const QabQ4RowsSmem<ST, KD, G, ROWS> sm(wsm);
  uint4* wst = sm.w;
  ST* sst = sm.s;
  ST* bst = sm.b;
  const int tid = threadIdx.x;
  const int nrows = nout - row0 < ROWS ? nout - row0 : ROWS;
  const uint4* wg = reinterpret_cast<const uint4*>(w + (size_t)row0 * (KD / 8));
  for (int e = tid; e < nrows * NC; e += BLOCK) {
    qab_cp_async16(wst + e, wg + e);
  }
  const ST* sg = scales + (size_t)row0 * GPR;
  const ST* bg = biases + (size_t)row0 * GPR;
  if (SB16 && ((reinterpret_cast<uintptr_t>(sg) | reinterpret_cast<uintptr_t>(bg)) & 15) == 0) {
    constexpr int SQ = SB16 ? GPR * (int)sizeof(ST) / 16 : 1;  // uint4 per row
    for (int e = tid; e < nrows * SQ; e += BLOCK) {
      qab_cp_async16(reinterpret_cast<uint4*>(sst) + e, reinterpret_cast<const uint4*>(sg) + e);
      qab_cp_async16(reinterpret_cast<uint4*>(bst) + e, reinterpret_cast<const uint4*>(bg) + e);
    }
  } else {
    for (int e = tid; e < nrows * GPR; e += BLOCK) {
      sst[e] = sg[e];
      bst[e] = bg[e];
    }
  }
  qab_cp_async_commit();
}

// qab_q4_gemv_rows for ROWS rows per block whose weights, scales and biases
// are staged in shared memory (`wsm`, dynamic, at least ROWS (KD / 2 + 2 (KD /
// G) sizeof(ST)) bytes, 16-byte aligned: ops.moe.decode_block_dynamic_shared_bytes) by cp.async
// before `wait`: a block keeps ROWS rows' loads in flight without holding
// them in registers, so that fewer, larger blocks cover a projection
// (moe_decode_block.cu's next-projection items with PSM: 12,352 rows in 193
// blocks of 64 instead of 772 of 16, which fit the GPU's resident blocks
// when the phase starts instead of arriving in waves; measured not faster on
// an H100, their loads competing with the down items'). Rows are warp w's
// w * ROWS / NW + r, r < ROWS / NW; each row's arithmetic (lane l's chunks
// l, l + 32, ..., the same fmaf order, the same warp sum) is
// qab_q4_gemv_rows's, so the outputs are bit-identical. Scales and biases
// are copied with cp.async when each row's (KD / G) ST values fill whole
// 16-byte units and the arrays' addresses are 16-byte aligned, else by plain
// loads. issue false: the caller has issued these rows' copies already
// (qab_q4_rows_stage_issue with the same row0, nout, arrays and wsm), and
// they complete at this call's cp.async wait. Every thread of the block must
// call it (block barriers).
template <typename OutT, typename ST, int KD, int G, int ROWS, int BLOCK, typename XF,
          typename Wait = QabNoWait>
__device__ __forceinline__ void qab_q4_gemv_rows_staged(
    const int row0, const int nout, const XF xv_of, const uint32_t* w, const ST* scales,
    const ST* biases, OutT* y, float4* stage, float* stage_sum, uint4* wsm, Wait wait = Wait(),
    const bool issue = true) {
  static_assert(KD % 1024 == 0 && G % 32 == 0, "qab_q4_gemv_rows_staged: KD % 1024, G % 32");
  constexpr int NW = BLOCK / 32;
  static_assert(ROWS % NW == 0, "qab_q4_gemv_rows_staged: ROWS a multiple of the block's warps");
  constexpr int RPWS = ROWS / NW;  // rows per warp
  constexpr int NC = KD / 32;      // 32-value chunks per row (a uint4 of weights each)
  constexpr int CPL = NC / 32;     // chunks per lane
  constexpr int GPR = KD / G;      // quantization groups per row
  auto& xs = *reinterpret_cast<float4(*)[8][NC]>(stage);
  float* xsum = stage_sum;
  const QabQ4RowsSmem<ST, KD, G, ROWS> sm(wsm);  // qab_q4_rows_stage_issue's layout
  const uint4* wst = sm.w;                       // [ROWS][NC]
  const ST* sst = sm.s;                          // [ROWS][GPR]
  const ST* bst = sm.b;                          // [ROWS][GPR]
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int nrows = nout - row0 < ROWS ? nout - row0 : ROWS;

  if (issue) {
    qab_q4_rows_stage_issue<ST, KD, G, ROWS, BLOCK>(row0, nout, w, scales, biases, wsm);
  }
  wait();
  qab_q4_stage_x_sums<NC, BLOCK, QAB_Q4_PS>(xs, xsum, xv_of);
  qab_cp_async_wait<0>();
  __syncthreads();
  QAB_SUBMARK(5);  // (profiling builds: the input and the rows staged)
  float acc[RPWS];
#pragma unroll
  for (int r = 0; r < RPWS; ++r) {
    acc[r] = 0.f;
  }
#pragma unroll
  for (int i = 0; i < CPL; ++i) {
    const int c = lane + 32 * i;
    float xv[32];
    qab_q4_chunk_x<NC>(xs, c, xv);
    const float s = xsum[c];
    const int gi = (c * 32) / G;
#pragma unroll
    for (int r = 0; r < RPWS; ++r) {
      const int row = warp * RPWS + r;
      if (row < nrows) {
        const float sc = static_cast<float>(sst[row * GPR + gi]);
        const float bi = static_cast<float>(bst[row * GPR + gi]);
        acc[r] = fmaf(sc, qab_q4_dot32<QAB_Q4_PS>(wst[row * NC + c], xv), fmaf(bi, s, acc[r]));
      }
    }
  }
  QAB_SUBMARK(6);  // (profiling builds: thread 0's dots done)
#pragma unroll
  for (int r = 0; r < RPWS; ++r) {
    const int row = warp * RPWS + r;
    const float v = qab_warp_sum(acc[r]);
    if (lane == 0 && row < nrows) {
      y[row0 + row] = static_cast<OutT>(v);
    }
  }
  QAB_SUBMARK(7);  // (profiling builds: thread 0's rows written)
}
