// One decode token of a whole Gated DeltaNet layer, short of its projections,
// in one launch, for MLX's mx.fast.cuda_kernel. Per batch row b and value head
// hv (key head hk = hv / (Hv / Hk)), with the conv input
// x = [conv_state[b] (Kc - 1 rows); qkv[b]] and m = mask[b]:
//   conv  = SiLU(sum_j conv_w[c, j] * x[j, c] (+ conv_b[c])), c in q_hk | k_hk | v_hv
//   k     = k / sqrt(|k|^2 + 1e-6);  q = q / sqrt(|q|^2 + 1e-6) / sqrt(Dk)
//   g     = exp(-exp(A_log) * softplus(a + dt_bias));  beta = sigmoid(b)
//   s     = g * s;  delta = beta * (v - s k);  s = s + delta k^T;  y = s q
//   out   = silu(z) * rms_norm(y, norm_w, eps)
// (Yang et al., "Gated Delta Networks", ICLR 2025; the op order of mlx-lm's
// qwen3_5.GatedDeltaNet). Where m is false the recurrent state is passed
// through, out is zero and the conv input row of this token is zero. The conv
// state shifts by one row unless HAS_LENGTHS and lengths[b] <= 0 (a finished
// row of a batched generation), as the portable path does.
//
// One block of BLOCK threads per (b, hv). Phase 1: the block recomputes the
// conv + SiLU of the 2 Dk + Dv channels it reads (the q, k channels of its key
// head are recomputed by each of the Hv / Hk value heads sharing them: cheap)
// into shared memory, and writes their new conv state: v channels by every
// block, q and k channels only by the first value head of each key head, so
// each element is written once. Phase 2: every warp l2-normalises q and k
// from shared memory (redundant per warp, which saves a barrier). Phase 3:
// warp w owns state rows dv = r * NW + w (r < RPW), each lane Dk / 32 floats
// of a row in registers (element i * 32 + lane, so loads and stores coalesce);
// all of the block's state loads are issued before phase 1, so their latency
// overlaps the conv. The rows' dot products reduce by warp butterflies,
// interleaved across the warp's rows. Phase 4: the Dv outputs of the head go
// through shared memory to the gated RMSNorm (one more butterfly per warp).
// Sums and the recurrence are float32; every intermediate that mlx-lm's ops
// path keeps in the input dtype (conv output, bias add, sigmoid and SiLU,
// normalised q and k, a + dt_bias, softplus, beta, y, the normalised and the
// weighted y) is rounded to InT at the same point (a no-op for float32), so
// bf16 results track stock mlx-lm's bf16 results, not a float32 reference.
//
// H200 mapping: decode is latency-bound (B * Hv = 32 blocks for one token of
// Qwen3.6-35B-A3B, 64 KB of state in and out per block), so the design keeps
// one head per block (the RMSNorm needs all Dv outputs of a head), puts every
// state load of the block in flight at once, and uses 256 threads: with no
// __launch_bounds__ the compiler may use up to 255 registers, and 256 x 255
// still fits the 64K register file, so the launch can never fail for register
// pressure. At Dk = Dv = 128: RPW = 16 rows per warp, 64 state floats + 8 q/k
// floats per lane (an estimated 100-130 registers; not measured); shared
// memory (2 Dk + 2 Dv) * 4 = 2 KB.
// The dispatcher keeps RPW * Dk / 32 <= 64.
//
// qab_gdn_decode_head runs what one block computes for batch row b and value
// head hv: gated_delta_decode.cu calls it once per block (b, hv from
// blockIdx.y), moe_decode_block.cu's GD phase once per item. Every thread of
// the block must call it (it has block barriers). Pointers and layouts: the
// inputs and outputs of gated_delta_decode.cu (mask and lengths read only
// when HAS_MASK / HAS_LENGTHS; any pointer type otherwise). PASSES > 1 runs
// phase 3 over a warp's rows in that many passes of RPW / PASSES rows, each
// pass's state loads issued as the pass starts (the first pass's before phase
// 1): fewer state floats live in registers (the MoE block's GD phase, where
// the whole launch's register count would otherwise grow: 168 against 124
// registers per thread with nvcc 13 for sm_90, one block of 256 threads per SM
// instead of two). Each row's arithmetic is the same in every pass layout,
// so the results are bit-identical.
// SPLIT > 1 (the MoE block's GD phase with GDS): the call covers only part
// `part` of the head's Dv state rows, Dv / SPLIT of them (the value channels
// it convolves, its state rows, their outputs), so that SPLIT blocks share a
// head and each keeps all of its state loads in flight at once; it writes
// the head's outputs BEFORE the gated RMSNorm, y rounded to InT, into out, and
// the caller applies phase 4 (qab_gdn_gated_norm_inv and qab_gdn_gated_out:
// the same arithmetic in the same order, the same bits). Each row's
// arithmetic is the unsplit call's.

// Sub-step marks of profiling builds (common.cuh's; the standalone kernel does
// not include common.cuh): nothing here.
#ifndef QAB_SUBMARK
#define QAB_SUBMARK(k)
#endif
template <typename InT, typename WT, int Hk, int Hv, int Dk, int Dv, int Kc, int BLOCK,
          bool HAS_BIAS, bool HAS_MASK, bool HAS_LENGTHS, int PROJ_W, int PASSES = 1,
          int SPLIT = 1, typename MT, typename LT>
__device__ __forceinline__ void qab_gdn_decode_head(
    const int b, const int hv, const InT* qkv, const InT* z, const InT* b_proj,
    const InT* a_proj, const InT* conv_state, const WT* conv_w, const WT* conv_b,
    const float* A_log, const WT* dt_bias, const WT* norm_w, const float* norm_eps,
    const float* state_in, const MT* mask, const LT* lengths, InT* out, InT* conv_state_out,
    float* state_out, const int part = 0) {
  static_assert(SPLIT >= 1 && Dv % SPLIT == 0, "qab_gdn_decode_head: SPLIT must divide Dv");
  constexpr int DVS = Dv / SPLIT;           // this call's state rows
  constexpr int NW = BLOCK / 32;            // warps per block
  constexpr int RPW = (DVS + NW - 1) / NW;  // state rows per warp
  static_assert(PASSES >= 1 && RPW % PASSES == 0, "qab_gdn_decode_head: PASSES must divide RPW");
  constexpr int RPP = RPW / PASSES;         // state rows per warp and pass
  constexpr int NPER = Dk / 32;             // state floats per lane and row
  constexpr int KEY_DIM = Hk * Dk;
  constexpr int CONV_DIM = 2 * KEY_DIM + Hv * Dv;
  // Where the projections are read: PROJ_W = 0, four arrays; else qkv, z,
  // b_proj and a_proj are one [B, PROJ_W] array, the concatenated input
  // projection's row qkv | z | b | a (no split views to encode per token).
  constexpr int QKV_ROW = PROJ_W ? PROJ_W : CONV_DIM;
  constexpr int Z_ROW = PROJ_W ? PROJ_W : Hv * Dv;
  constexpr int Z_OFF = PROJ_W ? CONV_DIM : 0;
  constexpr int BA_ROW = PROJ_W ? PROJ_W : Hv;
  constexpr int B_OFF = PROJ_W ? CONV_DIM + Hv * Dv : 0;
  constexpr int A_OFF = PROJ_W ? CONV_DIM + Hv * Dv + Hv : 0;
  constexpr int NCH = 2 * Dk + DVS;         // conv channels this block reads
  constexpr float QK_EPS = 1e-6f;
  __shared__ float conv_s[NCH];             // SiLU(conv): q (Dk), k (Dk), v (Dv)
  __shared__ float y_s[DVS];

  // Round to the input dtype and back, where the ops path rounds.
  auto rnd = [](float v) { return static_cast<float>(static_cast<InT>(v)); };

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int bh = b * Hv + hv;
  const int hk = hv / (Hv / Hk);
  const int dv0 = part * DVS;               // this call's first state row
  const bool live = HAS_MASK ? static_cast<bool>(mask[b]) : true;
  const bool shift = HAS_LENGTHS ? lengths[b] > 0 : true;

  // State loads first (the first pass's rows): in flight during the conv phase.
  const size_t sbase = ((size_t)bh * Dv + dv0) * Dk;
  float s[RPP][NPER];
  auto load_state = [&](const int pass) {
#pragma unroll
    for (int r = 0; r < RPP; ++r) {
      const int dv = (pass * RPP + r) * NW + warp;
#pragma unroll
      for (int i = 0; i < NPER; ++i) {
        s[r][i] = dv < DVS ? state_in[sbase + (size_t)dv * Dk + i * 32 + lane] : 0.f;
      }
    }
  };
  load_state(0);

  // Phase 1: conv + SiLU of this block's channels; new conv state.
  for (int c = tid; c < NCH; c += BLOCK) {
    int ch;
    bool owner;
    if (c < Dk) {
      ch = hk * Dk + c;
      owner = hv % (Hv / Hk) == 0;
    } else if (c < 2 * Dk) {
      ch = KEY_DIM + hk * Dk + (c - Dk);
      owner = hv % (Hv / Hk) == 0;
    } else {
      ch = 2 * KEY_DIM + hv * Dv + dv0 + (c - 2 * Dk);
      owner = true;
    }
    if (c < 2 * Dk) {
      owner = owner && part == 0;
    }
    float x[Kc];
#pragma unroll
    for (int j = 0; j < Kc - 1; ++j) {
      x[j] = static_cast<float>(conv_state[((size_t)b * (Kc - 1) + j) * CONV_DIM + ch]);
    }
    x[Kc - 1] = live ? static_cast<float>(qkv[(size_t)b * QKV_ROW + ch]) : 0.f;
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < Kc; ++j) {
      acc += static_cast<float>(conv_w[(size_t)ch * Kc + j]) * x[j];
    }
    acc = rnd(acc);
    if (HAS_BIAS) {
      acc = rnd(acc + static_cast<float>(conv_b[ch]));
    }
    conv_s[c] = rnd(acc * rnd(1.f / (1.f + expf(-acc))));  // SiLU = x * sigmoid(x)
    if (owner) {
      const int from = shift ? 1 : 0;
#pragma unroll
      for (int j = 0; j < Kc - 1; ++j) {
        conv_state_out[((size_t)b * (Kc - 1) + j) * CONV_DIM + ch] = static_cast<InT>(x[j + from]);
      }
    }
  }

  // Gates (every thread; scalars of this head).
  const float decay = expf(A_log[hv]);
  const float ax = rnd(static_cast<float>(a_proj[(size_t)b * BA_ROW + A_OFF + hv]) + static_cast<float>(dt_bias[hv]));
  const float sp = rnd(fmaxf(ax, 0.f) + log1pf(expf(-fabsf(ax))));  // softplus, stable
  const float gate = expf(-decay * sp);
  const float beta = rnd(1.f / (1.f + expf(-static_cast<float>(b_proj[(size_t)b * BA_ROW + B_OFF + hv]))));
  __syncthreads();
  QAB_SUBMARK(5);  // (profiling builds: the conv and the gates done)

  // Phase 2: l2-normalised k and q (q also scaled by Dk^-0.5), this lane's part,
  // as the ops path: rms_norm with eps / Dk, then times Dk^-0.5 (k) or 1 / Dk (q).
  float kn[NPER], qn[NPER];
  float kk = 0.f, qq = 0.f;
#pragma unroll
  for (int i = 0; i < NPER; ++i) {
    qn[i] = conv_s[i * 32 + lane];
    kn[i] = conv_s[Dk + i * 32 + lane];
    qq += qn[i] * qn[i];
    kk += kn[i] * kn[i];
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    qq += __shfl_xor_sync(0xffffffffu, qq, o);
    kk += __shfl_xor_sync(0xffffffffu, kk, o);
  }
  const float kinv = rsqrtf(kk / Dk + QK_EPS / Dk);
  const float qinv = rsqrtf(qq / Dk + QK_EPS / Dk);
  const float kmul = rnd(1.f / sqrtf(static_cast<float>(Dk)));
  const float qmul = rnd(1.f / static_cast<float>(Dk));
#pragma unroll
  for (int i = 0; i < NPER; ++i) {
    kn[i] = rnd(kmul * rnd(kn[i] * kinv));
    qn[i] = rnd(qmul * rnd(qn[i] * qinv));
  }

  QAB_SUBMARK(6);  // (profiling builds: q and k normalised)
  // Phase 3: the recurrent step on this warp's rows, RPP rows per pass.
#pragma unroll 1
  for (int pass = 0; pass < PASSES; ++pass) {
    if (pass > 0) {
      load_state(pass);
    }
    float yr[RPP];
#pragma unroll
    for (int r = 0; r < RPP; ++r) {
      yr[r] = 0.f;
    }
    if (live) {
      float kv[RPP];
#pragma unroll
      for (int r = 0; r < RPP; ++r) {
        kv[r] = 0.f;
#pragma unroll
        for (int i = 0; i < NPER; ++i) {
          s[r][i] *= gate;
          kv[r] += s[r][i] * kn[i];
        }
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
        for (int r = 0; r < RPP; ++r) {
          kv[r] += __shfl_xor_sync(0xffffffffu, kv[r], o);
        }
      }
#pragma unroll
      for (int r = 0; r < RPP; ++r) {
        const int dv = (pass * RPP + r) * NW + warp;
        const float vr = dv < DVS ? conv_s[2 * Dk + dv] : 0.f;
        const float delta = (vr - kv[r]) * beta;
#pragma unroll
        for (int i = 0; i < NPER; ++i) {
          s[r][i] += kn[i] * delta;
          yr[r] += s[r][i] * qn[i];
        }
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
        for (int r = 0; r < RPP; ++r) {
          yr[r] += __shfl_xor_sync(0xffffffffu, yr[r], o);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < RPP; ++r) {
      const int dv = (pass * RPP + r) * NW + warp;
      if (dv < DVS) {
#pragma unroll
        for (int i = 0; i < NPER; ++i) {
          state_out[sbase + (size_t)dv * Dk + i * 32 + lane] = s[r][i];
        }
        if (lane == 0) {
          if constexpr (SPLIT > 1) {
            out[(size_t)bh * Dv + dv0 + dv] = static_cast<InT>(rnd(yr[r]));
          } else {
            y_s[dv] = rnd(yr[r]);
          }
        }
      }
    }
    QAB_SUBMARK(7 + pass);  // (profiling builds: thread 0's pass done)
  }
  if constexpr (SPLIT > 1) {
    return;  // the caller's phase 4 (qab_gdn_gated_norm_inv, qab_gdn_gated_out)
  }
  __syncthreads();

  // Phase 4: gated RMSNorm over the head's Dv outputs.
  float ss = 0.f;
  for (int i = lane; i < Dv; i += 32) {
    ss += y_s[i] * y_s[i];
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    ss += __shfl_xor_sync(0xffffffffu, ss, o);
  }
  const float inv = rsqrtf(ss / static_cast<float>(Dv) + norm_eps[0]);
  for (int dv = tid; dv < Dv; dv += BLOCK) {
    // rms_norm rounds x * inv to the input dtype, then multiplies by the weight.
    const float xw = rnd(static_cast<float>(norm_w[dv]) * rnd(y_s[dv] * inv));
    const float zz = static_cast<float>(z[(size_t)b * Z_ROW + Z_OFF + (size_t)hv * Dv + dv]);
    out[(size_t)bh * Dv + dv] = static_cast<InT>(zz / (1.f + expf(-zz)) * xw);
  }
}

// Phase 4 of qab_gdn_decode_head for a caller of its SPLIT build, which wrote
// the head's y (rounded to InT) before the gated RMSNorm. inv of one head:
// a warp's lanes sum y[i]^2 over i = lane, lane + 32, ... (y from `y_of`, a
// functor giving y[i] of the head as float), then the butterfly, as phase 4
// does in every warp: the same bits. Every lane of the warp must call it;
// every lane gets inv.
template <int Dv, typename YF>
__device__ __forceinline__ float qab_gdn_gated_norm_inv(const YF y_of, const int lane,
                                                        const float eps) {
  float ss = 0.f;
#pragma unroll
  for (int i = lane; i < Dv; i += 32) {
    const float v = y_of(i);
    ss += v * v;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    ss += __shfl_xor_sync(0xffffffffu, ss, o);
  }
  return rsqrtf(ss / static_cast<float>(Dv) + eps);
}

// Phase 4's output for one element: silu(z) * rms_norm(y) * norm_w, rounded
// as qab_gdn_decode_head rounds it (y: the InT-rounded output as float, inv:
// its head's qab_gdn_gated_norm_inv, w: norm_w[dv], zz: z of the element).
template <typename InT>
__device__ __forceinline__ InT qab_gdn_gated_out(const float y, const float inv, const float w,
                                                 const float zz) {
  auto rnd = [](float v) { return static_cast<float>(static_cast<InT>(v)); };
  const float xw = rnd(w * rnd(y * inv));
  return static_cast<InT>(zz / (1.f + expf(-zz)) * xw);
}
