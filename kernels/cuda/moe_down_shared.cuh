// The rows of the MoE decode fold's down kernel, shared by
// moe_down_shared_gemv.cu and moe_down_shared_norm_gemv.cu: warp `warp` computes
// output rows [QAB_DOWN_RPW warp, QAB_DOWN_RPW warp + QAB_DOWN_RPW) of token n,
// the K routed experts' 4-bit down projections weighted by the routing scores
// plus the shared expert's weighted by sigmoid(sg_logit[n]), summed; with
// HAS_RES plus the residual as the stock layer adds it. The arithmetic is
// described in moe_down_shared_gemv.cu. Every lane of the warp must call it,
// and every warp of the block when `wait` holds a block barrier (as
// moe_decode_block.cu's PREFETCH wait does) or with STAGE; the caller
// guarantees QAB_DOWN_RPW * warp < H. With CG (moe_decode_block.cu, where
// other blocks of the same launch wrote them) h, inds, scores, sg_logit and
// res are read through L2 (ld.global.cg); the weights as before. STAGE (needs
// CG) stages token n's h in shared memory once per block (cp.async.cg) after
// the wait, and reads res before it.
//
// Loads in flight: a row's (K + 1) * I / 32 (slot, 32-value chunk) tasks go to
// the lanes as task = lane + 32 i (a half warp reads one slot's 256 bytes of a
// row); the slot and chunk of a lane's i-th task are the same for every row,
// so the lane reads its experts' indices and weights once, then issues every
// weight, scale and bias load of all QAB_DOWN_RPW rows before any arithmetic
// (a decode GEMV lives on loads in flight: one 16-byte load per lane at a time
// streamed ~0.16 TB/s), and reads each h chunk once (16-byte loads) for all rows.

constexpr int QAB_DOWN_RPW = 2;  // output rows per warp

// STAGE's shared-memory copy of token n's h (one buffer per instantiation).
template <typename HT, int N>
__device__ __forceinline__ HT* qab_down_h_smem() {
  __shared__ __align__(16) HT buf[N];
  return buf;
}

template <typename OutT, int H, int I, int K, int G, bool HAS_RES, bool CG = false,
          bool STAGE = false, bool ROLL = false, typename HT, typename ST, typename QT,
          typename SQT, typename RT, typename Wait = QabNoWait>
__device__ __forceinline__ void qab_moe_down_shared_rows(
    const int warp, const int lane, const int n, const HT* h, const uint32_t* inds,
    const ST* scores, const uint32_t* w, const QT* scales, const QT* biases,
    const uint32_t* s_down_w, const SQT* s_down_scales, const SQT* s_down_biases,
    const float* sg_logit, const RT* res, OutT* y, Wait wait = Wait()) {
  constexpr int RPW = QAB_DOWN_RPW;
  constexpr int CPR = I / 32;         // 32-value chunks per weight row
  constexpr int WPR = I / 8;          // uint32 words per weight row
  constexpr int GPR = I / G;          // quantization groups per row
  constexpr int KS = K + 1;           // slots: K routed experts, then the shared one
  constexpr int TASKS = KS * CPR;     // (slot, chunk) tasks per row
  constexpr int TPL = (TASKS + 31) / 32;  // tasks per lane

  // This lane's tasks: slot, chunk, expert and routing weight (row-independent).
  int slot[TPL];
  size_t expert_row[TPL];  // first row of the slot's [H, I] matrix
  float weight[TPL];
#pragma unroll
  for (int i = 0; i < TPL; ++i) {
    const int task = lane + 32 * i;
    const int k = task < TASKS ? task / CPR : K;
    slot[i] = k;
    // Slot K reads the shared expert's own arrays; inds and scores have no column K.
    expert_row[i] = k == K ? 0 : static_cast<size_t>(qab_ld<CG>(inds + (size_t)n * K + k)) * H;
    weight[i] = k == K ? 0.f : static_cast<float>(qab_ld<CG>(scores + (size_t)n * K + k));
  }

  // Every weight, scale and bias load of this warp's rows, before any arithmetic.
  uint4 wv[RPW][TPL];
  float sv[RPW][TPL];
  float bv[RPW][TPL];
#pragma unroll
  for (int p = 0; p < RPW; ++p) {
    const int o = warp * RPW + p;
#pragma unroll
    for (int i = 0; i < TPL; ++i) {
      const int task = lane + 32 * i;
      const int c = task - (task / CPR) * CPR;
      if (task < TASKS) {
        const bool is_shared = slot[i] == K;
        const size_t row = expert_row[i] + o;
        const uint32_t* wrow = is_shared ? s_down_w + row * WPR : w + row * WPR;
        wv[p][i] = reinterpret_cast<const uint4*>(wrow)[c];
        const size_t gi = row * GPR + (c * 32) / G;
        sv[p][i] = is_shared ? static_cast<float>(s_down_scales[gi])
                             : static_cast<float>(scales[gi]);
        bv[p][i] = is_shared ? static_cast<float>(s_down_biases[gi])
                             : static_cast<float>(biases[gi]);
      } else {
        wv[p][i] = make_uint4(0u, 0u, 0u, 0u);
        sv[p][i] = 0.f;
        bv[p][i] = 0.f;
      }
    }
  }

  // STAGE: the residual now (the route phase wrote it; the caller waited for it).
  float resv[RPW];
#pragma unroll
  for (int p = 0; p < RPW; ++p) {
    resv[p] = 0.f;
    if constexpr (STAGE && HAS_RES) {
      if (lane == 0) {
        resv[p] = static_cast<float>(qab_ldcg(res + (size_t)n * H + warp * RPW + p));
      }
    }
  }

  // h and sg_logit may still be in the making (moe_decode_block's prefetch:
  // the weights above needed only the route); wait() returns once they are written.
  QAB_SUBMARK(5);  // (profiling builds: the loads issued)
  wait();

  // STAGE: the block copies token n's h ([K + 1, I], written by other blocks of
  // the launch) into shared memory, one round of 16-byte L2 copies, instead of
  // each lane reading its chunks task after task below: with this warp's
  // weights in the registers those loads did not overlap (H200, the block's
  // per-ticket timeline: a down item took 5-14 us after its wait).
  const HT* hs = nullptr;
  if constexpr (STAGE) {
    static_assert(CG, "moe down rows: STAGE reads data of the same launch (CG)");
    static_assert((KS * I * sizeof(HT)) % 16 == 0, "moe down rows: h rows are 16-byte multiples");
    constexpr int V16 = KS * I * int(sizeof(HT)) / 16;
    HT* buf = qab_down_h_smem<HT, KS * I>();
    const uint4* src = reinterpret_cast<const uint4*>(h + (size_t)n * KS * I);
    for (int v = threadIdx.x; v < V16; v += blockDim.x) {
      qab_cp_async16(reinterpret_cast<uint4*>(buf) + v, src + v);
    }
    qab_cp_async_commit();
    qab_cp_async_wait<0>();
    __syncthreads();
    hs = buf;
  }
  QAB_SUBMARK(6);  // (profiling builds: h staged)
  const float shared_weight = 1.f / (1.f + expf(-qab_ld<CG>(sg_logit + n)));
#pragma unroll
  for (int i = 0; i < TPL; ++i) {
    if (slot[i] == K) {
      weight[i] = shared_weight;
    }
  }

  float acc[RPW];
#pragma unroll
  for (int p = 0; p < RPW; ++p) {
    acc[p] = 0.f;
  }
  // Task i's dot products for this warp's RPW rows, its loads at index ii of
  // the per-task arrays (ii == i, or 0 in the rolled loop below).
  auto task_dot = [&](const int i, const int ii) {
    const int task = lane + 32 * i;
    if (task < TASKS) {
      const int c = task - (task / CPR) * CPR;
      const size_t hb = ((size_t)n * KS + slot[ii]) * I + c * 32;
      float hv[32];
      const bool vec = qab_vec_aligned<HT, 8>(h + hb);
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        QabVec<HT, 8> chunk;
        if constexpr (STAGE) {
          chunk = *reinterpret_cast<const QabVec<HT, 8>*>(hs + slot[ii] * I + c * 32 + 8 * v);
        } else if constexpr (CG) {
          chunk = qab_load_vec_cg<HT, 8>(h + hb + 8 * v, vec);
        } else {
          chunk = qab_load_vec<HT, 8>(h + hb + 8 * v, 1, vec);
        }
#pragma unroll
        for (int b = 0; b < 8; ++b) {
          hv[8 * v + b] = static_cast<float>(chunk.v[b]);
        }
      }
      float hs = 0.f;
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        hs += hv[j];
      }
      if constexpr (QAB_Q4_PS) {
        qab_q4_prescale32(hv);
      }
#pragma unroll
      for (int p = 0; p < RPW; ++p) {
        const uint32_t words[4] = {wv[p][ii].x, wv[p][ii].y, wv[p][ii].z, wv[p][ii].w};
        const float d = qab_q4_words_dot<QAB_Q4_PS, false>(words, hv);
        acc[p] += weight[ii] * (sv[p][ii] * d + bv[p][ii] * hs);
      }
    }
  };
  // (ROLL: one task's code in a loop, common.cuh's qab_dot_loop.)
  qab_dot_loop<TPL, ROLL>(task_dot, [&]() { qab_shift_down(slot, weight, wv, sv, bv); });
  QAB_SUBMARK(7);  // (profiling builds: thread 0's dots done, its weights in)
#pragma unroll
  for (int p = 0; p < RPW; ++p) {
    const int o = warp * RPW + p;
    const float sum = qab_warp_sum(acc[p]);
    if (lane == 0) {
      const size_t i = (size_t)n * H + o;
      if (HAS_RES) {
        y[i] = static_cast<OutT>((STAGE ? resv[p] : static_cast<float>(qab_ld<CG>(res + i))) +
                                 static_cast<float>(static_cast<OutT>(sum)));
      } else {
        y[i] = static_cast<OutT>(sum);
      }
    }
  }
  QAB_SUBMARK(8);  // (profiling builds: thread 0's rows written)
}
