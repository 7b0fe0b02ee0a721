// One decode token's whole full-attention core in ONE launch, between the
// concatenated q/k/v projection and o_proj (Qwen3-Next / Qwen3.5 gated
// attention): what qk_norm_rope.cu, kv_cache_write.cu, the lane-group
// split-K pass gqa_decode_partial_lanes.cu and gqa_decode_combine.cu (with
// the gate) compute in four launches. Per batch row b, with the token at
// position p = offset and its projection row qkv[b] = [q | gate per query
// head (2 D each), k (Hk D), v (Hk D)]:
//
//   q_g = rope(rms_norm(q_g, q_weight), p),  k = rope(rms_norm(k, k_weight), p)
//   k_buf[b, h, p] = k,  v_buf[b, h, p] = v                       (IN PLACE)
//   out[b, g] = softmax(q_g k_buf[b, h, :p + 1]^T * scale) v_buf[b, h, :p + 1]
//               * sigmoid(gate_g)
//
// for each query head g of KV head h (GQA). The q/k arithmetic is
// qk_norm_rope.cuh's (qk_norm_rope.cu's bits), the pass over keys
// gqa_lanes.cuh's (gqa_decode_partial_lanes.cu's partials, without a mask:
// the keys are rows 0..p), the gate common.cuh's qab_sigmoid_gate (the
// combine's rounding); only the merge of the key blocks sums in another
// order than gqa_decode_combine.cu (float32: the output can differ from the
// four launches' in the last bit of InT). Flash-decoding (Dao et al.,
// "Flash-Decoding for long-context inference", 2023) with GQA packing.
//
// Why: decode on MLX's CUDA backend pays a host cost per launch, and the
// three small launches around the attention pass (q/k preparation, the KV
// write, the merge) cost GPU time for almost no work; here a Qwen3.6
// full-attention layer is one launch instead of four.
//
// One thread block per (b, KV head h, key block j) of WARPS warps, key block
// j = keys [j BLOCK, (j + 1) BLOCK) of the p + 1 keys:
// 1. the block's warps normalise and rotate the G query heads of h (one warp
//    per head, as qk_norm_rope.cu) into shared memory (scaled to log2 units
//    as float32 for the lane-group pass, as rounded InT for the MMA pass);
//    the block holding key p also normalises and rotates the new key row and
//    writes it and the value row into the cache buffers, before a barrier
//    (its own warps then read them back; no other block reads row p);
// 2. its keys on tensor cores (MMA build and K/V rows that allow 16-byte
//    loads: gqa_mma.cuh's qab_mma_block) or as the lane-group pass
//    (qab_lanes_block); warp 0 writes the block's partial (m, l, o) per query
//    head to o_part / ml (a block past key p stages nothing and writes m =
//    -inf, l = 0, o = 0);
// 3. the block meets at a barrier, thread 0 fences and counts the block done
//    in count[b Hk + h]; the last of the NB blocks of (b, h) (the count it
//    read is NB - 1) fences, then merges: warp w takes query heads w, w +
//    WARPS, ...: M = max over the key blocks with keys, out = sum_j w_j o_j /
//    sum_j w_j l_j with w_j = exp2(m_j - M) (staged in shared memory; the o
//    rows read 16 at a time, every load of the 16 issued before their sums,
//    16 bytes per load where EPL is a multiple of 4 (as the partials are
//    written; 4-byte loads took 20 of a 39 us launch at 4K keys on the H200,
//    16-byte ones 11), read through L2 (the CG
//    loads), rounded once to InT, times the sigmoid gate; then it resets the count
//    to 0. So count must be zeros at launch and is zeros again after it;
//    launches sharing it must not overlap (the compiled decode step's
//    launches run one after another).
//
// The caller owns k_buf / v_buf exclusively (see kv_cache_write.cu; MLX does
// not know they change) and reads no other array of this launch's writes but
// out. Keys past p in the buffers are never read.
//
// Launch: grid (32 * WARPS * NB, Hk, B) threads, threadgroup (32 * WARPS, 1,
// 1), NB = ceil(S / BLOCK) (S: the buffers' length). Inputs: qkv [B, 1, N]
// InT, N = Hq * 2 D + 2 Hk D (any strides); q_weight, k_weight [D] InT;
// params [8] float32 (q eps, k eps, RoPE scale, log2(RoPE base), attention
// scale, unused); offset int32, one element (0 <= offset < S); k_buf, v_buf
// [B, Hk, S, D] InT (any strides; row offset written); count uint32, >= B Hk
// elements (zeros; PM: B Hk (1 + NG)). Outputs: out [B, 1, Hq D] InT; ws: the partials, o_part
// [B, Hq, NB, D] then ml [B, Hq, NB, 2] float32 (PM: then o2, ml2), in one workspace (scratch
// for the caller: one output instead of two, as moe_decode_block.cu says why).
// Template MMA: build the tensor-core pass too (InT bf16 / f16, G <= 8, D a
// multiple of 64; the pass runs where the K/V rows allow, checked here).
// Template PM (two-level merge): the key blocks of (b, h) in NG groups of GS
// = ceil(sqrt(NB)); the last block of each group to count (in the group's
// counter, count[B Hk + (b Hk + h) NG + group]) merges the group's key blocks
// into a level-2 partial (o2, ml2 after ml in ws), resets the group's count
// and counts in count[b Hk + h]; the last of the NG merges the groups'
// partials and applies the gate. One SM merging every key block read ~0.5 MB
// of partials through L2 at 4K keys (11 of a 23 us launch on the H200); here
// NG SMs read GS rows per head each, then one SM NG rows per head. The sums
// run in another order than without PM (float32). count then needs B Hk (1 +
// NG) elements and ws B Hq (NB + NG) (D + 2) floats (the callers size both:
// ops.attention.step_counter, _step_call).
// Template MS (the spread merge, not with PM; 0: off): MS more thread blocks
// per (b, h), so the grid is (32 * WARPS * (NB + MS), Hk, B). Every block takes
// a ticket as it starts (count[B Hk + b Hk + h]): tickets 0 .. NB - 1 are key
// blocks j, the last MS merging blocks, which wait (qab_wait_count) for the NB
// key blocks' count and then merge query heads t - NB, + MS, ... (t the
// ticket): a head's row over WPH = D / 32 warps (one float per lane; at D >
// 32 WARPS all warps, EPM floats per lane), HPB = WARPS / WPH heads at once
// (then heads t - NB + MS slot, stepping by MS HPB); M, the denominator and
// each element's sum in the same order and rounding as the one-block merge
// (the same bits); up to 64 rows (and at most the one-block merge's chunk,
// SMF / G) loaded in one trip, more in chunks. The one-block merge
// reads ~0.4 MB of partials through one SM at 4K keys (8 of its ~12 us on an
// H100); here each SM reads its head's 1/G. A merging block waits only on
// blocks that took earlier tickets, so are running. The last merging block
// resets the count and the tickets; count then needs 2 B Hk elements. The
// merging blocks' code is a function out of line (noinline), so a key block
// runs on into its staging code as without MS.
// Requires what gqa_decode_partial_lanes.cu and qk_norm_rope.cu require, G = Hq / Hk.

constexpr int EPL = D / 32;                  // elements per lane of a head row
constexpr int KPS = 32 / LPK;                // keys per warp step
constexpr int G8 = G > 8 ? G : 8;            // heads the MMA pass's arrays hold
constexpr int SMF_L = qab_lanes_smem_floats<InT, D, G, WARPS>();
constexpr int SMF_M = (WARPS > 1 ? WARPS / 2 : 1) * 8 * D;
constexpr int SMF = MMA && SMF_M > SMF_L ? SMF_M : SMF_L;  // floats
static_assert(BLOCK % KPS == 0 && BLOCK % 8 == 0, "BLOCK must be a multiple of 8 and 32 / LPK");
static_assert(!MMA || (G <= 8 && sizeof(InT) == 2 && D % 64 == 0),
              "the MMA pass takes 16-bit inputs, G <= 8 and D a multiple of 64");
static_assert(SMF * 4 + 2 * WARPS * G8 * 4 + (MMA ? 8 * D * sizeof(InT) : 16) + 16 <= 48 * 1024,
              "static shared memory over 48 KB");
__shared__ __align__(16) float sm[SMF];
__shared__ float sm_m[WARPS * G8];
__shared__ float sm_l[WARPS * G8];
__shared__ __align__(16) InT sq[MMA ? 8 * D : 8];
__shared__ int sm_last;
static_assert(MS >= 0 && !(MS > 0 && PM), "MS merging blocks or the two-level merge PM, not both");
const int lane = threadIdx.x & 31;
const int w = threadIdx.x >> 5;
// MS: the thread blocks of (b, h) take tickets in the order they start (its
// counter after the B Hk counts): tickets 0 .. NB - 1 are the key blocks,
// the last MS the merging blocks, which so wait only on blocks already running.
__shared__ int sm_ticket;
if constexpr (MS > 0) {
  if (threadIdx.x == 0) {
    sm_ticket = static_cast<int>(atomicAdd(const_cast<uint32_t*>(count) + (int64_t)gridDim.z *
                                           gridDim.y + (int64_t)blockIdx.z * gridDim.y +
                                           blockIdx.y, 1u));
  }
  __syncthreads();
}
const int j = MS > 0 ? sm_ticket : static_cast<int>(blockIdx.x);
const int h = blockIdx.y;
const int b = blockIdx.z;
const int Hk = gridDim.y;
const int Hq = Hk * G;
const int NB = gridDim.x - MS;               // key blocks (MS: then MS merging blocks)
float* o_part = ws;
float* ml = ws + (size_t)gridDim.z * Hq * NB * D;
const int off = offset[0];
const int n = off + 1;                       // keys 0..off: the cache's and this token's
const int NBe = (n + BLOCK - 1) / BLOCK;     // key blocks holding keys
const InT* row = qkv + (int64_t)b * qkv_strides[0];
const int64_t es = qkv_strides[2];
const float pos = params[2] * static_cast<float>(off);
const int s0 = j * BLOCK;
const int s1 = min(s0 + BLOCK, n);
const InT* kh = k_buf + (int64_t)b * k_buf_strides[0] + (int64_t)h * k_buf_strides[1];
const InT* vh = v_buf + (int64_t)b * v_buf_strides[0] + (int64_t)h * v_buf_strides[1];
// The tensor-core pass where the build has it and the K/V rows allow 16-byte
// loads (contiguous along the head dim, rows 16-byte aligned); else the
// lane-group pass.
const bool mma = MMA && k_buf_strides[3] == 1 && v_buf_strides[3] == 1 &&
                 k_buf_strides[2] % 8 == 0 && v_buf_strides[2] % 8 == 0 &&
                 qab_vec_aligned<InT, 8>(kh) && qab_vec_aligned<InT, 8>(vh);
QAB_MARK(0);
if constexpr (MS > 0) {
  if (j >= NB) {
    // A merging block's work as a function out of line (noinline), so that in
    // the binary a key block's staging code follows its start as without MS
    // (inline, the merge's ~45 KB of code lay between them). Its values are
    // captured by copy, here: captured by reference, the key blocks' variables
    // would live in local memory (every block's loads of them from the stack).
    const auto merge = [=]() __attribute__((noinline)) {
      // A merging block (MS): query heads g = j - NB, + MS, ... of (b, h), once
      // the NB key blocks have counted: the merge below, each head's rows
      // spread over WPH warps (EPM floats of each row per lane) instead of one
      // warp: M, the denominator and each element's sum over the rows in the
      // same order and rounding (the same bits), the rows' loads spread over
      // MS SMs instead of one.
      constexpr int EPM = D > 32 * WARPS ? D / (32 * WARPS) : 1;  // floats per lane of a row
      constexpr int WPH = D / (32 * EPM);                          // warps per head
      constexpr int HPB = WARPS / WPH;                             // heads merged at once
      constexpr int MCHS = SMF / G;                                // the merge's chunk of rows
      constexpr int US = 16;                                       // the merge's U
      constexpr int RS = 2;                                        // groups of US rows in flight
      constexpr int RL = 2;                                        // rows per lane, one trip
      static_assert(D % (32 * EPM) == 0 && HPB >= 1, "a head row over whole warps of the block");
      uint32_t* const cnt0 = const_cast<uint32_t*>(count) + (int64_t)b * Hk + h;
      const int hs = w / WPH;                  // this warp's head slot
      const int d0 = (w % WPH) * 32 * EPM + lane * EPM;
      const int g0 = j - NB + MS * hs;
      float gate[EPM];                         // the first head's gate, before the wait
      if (hs < HPB && g0 < G) {
#pragma unroll
        for (int e = 0; e < EPM; ++e) {
          gate[e] = static_cast<float>(row[(int64_t)((h * G + g0) * 2 * D + D + d0 + e) * es]);
        }
      }
      if (threadIdx.x == 0) {
        qab_wait_count(cnt0, static_cast<uint32_t>(NB));
      }
      __syncthreads();
      __threadfence();
      QAB_MARK(8);
      if (hs < HPB) {
        for (int g = g0; g < G; g += MS * HPB) {
          const int hq = h * G + g;
          const int64_t base = ((int64_t)b * Hq + hq) * NB;
          if (g != g0) {
#pragma unroll
            for (int e = 0; e < EPM; ++e) {
              gate[e] = static_cast<float>(row[(int64_t)(hq * 2 * D + D + d0 + e) * es]);
            }
          }
          float M = -INFINITY, den = 0.f, num[EPM];
#pragma unroll
          for (int e = 0; e < EPM; ++e) num[e] = 0.f;
          if (NBe <= 32 * RL && NBe <= MCHS) {
            // Up to 32 RL rows: every load in one trip (each row's o, a row past
            // NBe - 1 repeating it; each lane's rows' m and l), then the same
            // arithmetic in the same order, a row's m from its lane by a shuffle.
            float mr[RL], lr[RL], ov[32 * RL][EPM];
#pragma unroll
            for (int u = 0; u < 32 * RL; ++u) {
              const int i = min(u, NBe - 1);
#pragma unroll
              for (int e = 0; e < EPM; ++e) ov[u][e] = qab_ldcg(o_part + (base + i) * D + d0 + e);
            }
#pragma unroll
            for (int k = 0; k < RL; ++k) {
              const int i = lane + 32 * k;
              mr[k] = i < NBe ? qab_ldcg(ml + (base + i) * 2) : -INFINITY;
              lr[k] = i < NBe ? qab_ldcg(ml + (base + i) * 2 + 1) : 0.f;
            }
#pragma unroll
            for (int k = 0; k < RL; ++k) M = fmaxf(M, mr[k]);
#pragma unroll
            for (int x = 16; x > 0; x >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, x));
            QAB_MARK(5);
            float dl = 0.f;
#pragma unroll
            for (int k = 0; k < RL; ++k) {
              if (lane + 32 * k < NBe) {
                const float wi = exp2f(mr[k] - M);
                dl += wi * lr[k];
              }
            }
            den += qab_warp_sum(dl);
            QAB_MARK(6);
#pragma unroll
            for (int u = 0; u < 32 * RL; ++u) {
              if (u % US == 0 && u >= NBe) break;  // past the last group of US rows
              const float mi = __shfl_sync(0xffffffffu, mr[u / 32], u % 32);
              const float wi = u < NBe ? exp2f(mi - M) : 0.f;
#pragma unroll
              for (int e = 0; e < EPM; ++e) num[e] += wi * ov[u][e];
            }
            QAB_MARK(7);
          } else {
            for (int i = lane; i < NBe; i += 32) M = fmaxf(M, qab_ldcg(ml + (base + i) * 2));
#pragma unroll
            for (int x = 16; x > 0; x >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, x));
            QAB_MARK(5);
            for (int c0 = 0; c0 < NBe; c0 += MCHS) {
              const int c1 = min(c0 + MCHS, NBe);
              float dl = 0.f;
              for (int i = c0 + lane; i < c1; i += 32) {
                const float wi = exp2f(qab_ldcg(ml + (base + i) * 2) - M);
                dl += wi * qab_ldcg(ml + (base + i) * 2 + 1);
              }
              den += qab_warp_sum(dl);
              QAB_MARK(6);
              // The rows in groups of US (a row past c1 - 1 repeats it, weighed 0),
              // RS groups' loads issued before their sums.
              for (int i0 = c0; i0 < c1; i0 += US * RS) {
                float mv[RS * US], ov[RS * US][EPM];
#pragma unroll
                for (int u = 0; u < RS * US; ++u) {
                  const int i = min(i0 + u, c1 - 1);
                  mv[u] = qab_ldcg(ml + (base + i) * 2);
#pragma unroll
                  for (int e = 0; e < EPM; ++e) {
                    ov[u][e] = qab_ldcg(o_part + (base + i) * D + d0 + e);
                  }
                }
#pragma unroll
                for (int u = 0; u < RS * US; ++u) {
                  if (u % US == 0 && i0 + u >= c1) break;  // past the chunk's last group
                  const float wi = i0 + u < c1 ? exp2f(mv[u] - M) : 0.f;
#pragma unroll
                  for (int e = 0; e < EPM; ++e) num[e] += wi * ov[u][e];
                }
              }
              QAB_MARK(7);
            }
          }
#pragma unroll
          for (int e = 0; e < EPM; ++e) {
            const InT y = static_cast<InT>(num[e] / den);
            out[(int64_t)hq * D + (int64_t)b * Hq * D + d0 + e] = qab_sigmoid_gate<InT>(y, gate[e]);
          }
        }
      }
      // Counted past NB: the last merging block resets the count and the tickets.
      __syncthreads();
      if (threadIdx.x == 0 &&
          atomicAdd(cnt0, 1u) == static_cast<uint32_t>(NB + MS - 1)) {
        *cnt0 = 0u;
        cnt0[(int64_t)gridDim.z * Hk] = 0u;
      }
      QAB_MARK(4);
    };
    merge();
    return;
  }
}
#ifdef QAB_STEP_KV_PREFETCH
// (A profiling key, benchmarks/profile_attention_decode.py's step-kv-prefetch
// form.) This block's keys' K and V rows asked of the L2 at its start, one
// bulk prefetch each where its rows are one contiguous range, by the block's
// last thread (the first warps stage query rows first): the same values.
if (threadIdx.x == 32 * WARPS - 1 && s0 < s1 && k_buf_strides[3] == 1 &&
    v_buf_strides[3] == 1 && k_buf_strides[2] == D && v_buf_strides[2] == D) {
  const uint32_t bytes = static_cast<uint32_t>((s1 - s0) * D * sizeof(InT));
  qab_prefetch_l2(kh + (int64_t)s0 * D, bytes);
  qab_prefetch_l2(vh + (int64_t)s0 * D, bytes);
}
#endif

if (s0 < n) {
  // 1. The query heads, as qk_norm_rope.cu rounds them, scaled to log2 units.
  const float qscale = params[4] * 1.4426950408889634f;  // log2(e)
  for (int g = w; g < G; g += WARPS) {
    InT qo[EPL];
    qab_qk_norm_rope_row<InT, D, R, TRAD>(row + (int64_t)(h * G + g) * 2 * D * es, es,
                                          q_weight, params[0], pos, params[3], lane, qo);
    if (mma) {
      // As rounded (InT), unscaled: the MMA pass scales the scores.
#pragma unroll
      for (int e = 0; e < EPL; ++e) sq[g * D + lane * EPL + e] = qo[e];
    } else {
#pragma unroll
      for (int e = 0; e < EPL; ++e) {
        sm[qab_lanes_q_at<InT, D>(g, lane * EPL + e)] = static_cast<float>(qo[e]) * qscale;
      }
    }
  }
  if (mma && G < 8) {
    for (int i = threadIdx.x; i < (8 - G) * D; i += 32 * WARPS) {
      sq[G * D + i] = static_cast<InT>(0.f);  // query rows past G: zero
    }
  }
  if (j == off / BLOCK && w == WARPS - 1) {
    // This token's key and value rows, into the cache at row off.
    InT ko[EPL];
    qab_qk_norm_rope_row<InT, D, R, TRAD>(row + (int64_t)(Hq * 2 * D + h * D) * es, es,
                                          k_weight, params[1], pos, params[3], lane, ko);
    const InT* vn = row + (int64_t)(Hq * 2 * D + Hk * D + h * D) * es;
    InT* kw = const_cast<InT*>(k_buf) + (int64_t)b * k_buf_strides[0] +
              (int64_t)h * k_buf_strides[1] + (int64_t)off * k_buf_strides[2];
    InT* vw = const_cast<InT*>(v_buf) + (int64_t)b * v_buf_strides[0] +
              (int64_t)h * v_buf_strides[1] + (int64_t)off * v_buf_strides[2];
#pragma unroll
    for (int e = 0; e < EPL; ++e) {
      const int d = lane * EPL + e;
      kw[(int64_t)d * k_buf_strides[3]] = ko[e];
      vw[(int64_t)d * v_buf_strides[3]] = vn[(int64_t)d * es];
    }
  }
}
__syncthreads();  // the query rows staged, row off written
QAB_MARK(1);

// 2. The block's keys (none in a block past key off: m = -inf, l = 0, o = 0):
// the tensor-core pass (gqa_mma.cuh) where the build has it and the rows
// allow, else the lane-group pass; warp 0 writes the block's partial, as
// 16-byte pieces where it can (each lane's floats of a row are contiguous;
// rows of D floats from a 16-byte aligned base; the merge reads them so too).
const bool pvec = EPL % 4 == 0 && qab_vec_aligned<float, 4>(o_part);
if (mma) {
  if constexpr (MMA) {
    float mm, lm, om[D / 4];
    qab_mma_block<InT, D, WARPS>(sq, sm, sm_m, sm_l, kh, k_buf_strides[2], vh, v_buf_strides[2],
                                 s0, s1, params[4] * 1.4426950408889634f, mm, lm, om);
    if (w == 0) {
      qab_mma_store_partial<D, G>(om, mm, lm, o_part, ml, ((int64_t)b * Hq + h * G) * NB + j,
                                  NB, pvec);
    }
  }
} else {
  float m[G], l[G], o[G][EPL];
  qab_lanes_block<InT, D, G, LPK, WARPS, false>(
      sm, sm_m, sm_l, kh, k_buf_strides[2], k_buf_strides[3], vh, v_buf_strides[2],
      v_buf_strides[3], nullptr, 0, s0, s1, m, l, o);
  if (w == 0) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const int64_t prow = ((int64_t)b * Hq + h * G + g) * NB + j;
      qab_store_f32<EPL>(o_part + prow * D + lane * EPL, pvec, o[g]);
      if (lane == 0) {
        ml[prow * 2] = m[g];
        ml[prow * 2 + 1] = l[g];
      }
    }
  }
}

// 3. Count the block done; the last of (b, h) merges. With PM (and more
// than one group), the last block of each group of GS key blocks merges the
// group into a level-2 partial, and the last of those merges the groups.
QAB_MARK(2);
int GS = NB, NG = 1;  // key blocks per group, groups
if constexpr (PM) {
  GS = 1;
  while (GS * GS < NB) ++GS;
  NG = (NB + GS - 1) / GS;
}
const bool two = PM && NG > 1;
uint32_t* cnt = const_cast<uint32_t*>(count) + (int64_t)b * Hk + h;
// The group's counter (PM): after the B Hk level-2 counts, NG per (b, h).
uint32_t* gcnt = const_cast<uint32_t*>(count) + (int64_t)gridDim.z * Hk +
                 ((int64_t)b * Hk + h) * NG + j / GS;
const int q0 = j / GS * GS;                 // the group's first key block
const int q1 = min(q0 + GS, NB);            // and its end
__syncthreads();
if (threadIdx.x == 0) {
  __threadfence();
  if (two) {
    sm_last = atomicAdd(gcnt, 1u) == static_cast<uint32_t>(q1 - q0 - 1);
  } else {
    // (MS: the merging blocks merge; a key block only counts.)
    sm_last = atomicAdd(cnt, 1u) == static_cast<uint32_t>(NB - 1) && MS == 0;
  }
}
__syncthreads();
QAB_MARK(3);
if (!sm_last) {
  return;
}
__threadfence();
QAB_MARK(8);
// The merge, a warp per query head, of partial rows [r0, r1) (o rows of D
// floats at op, (m, l) pairs at mp; base: the head's row 0; every row holds
// keys: m finite): the rows' weights w_i = exp2(m_i - M) staged in shared
// memory (MCH rows at a time; the pass is done with it), then the o rows read
// U at a time, all U rows' loads issued before their sums. num, den, M: the
// unnormalised sums sum_i w_i o_i, sum_i w_i l_i and the max (-inf, 0 and 0
// for no rows).
constexpr int MCH = SMF / G;  // rows whose weights fit at once (>= 4 D)
constexpr int U = 16;         // o rows in flight per lane
auto merge_rows = [&](const float* op, const float* mp, const int64_t base, const int r0,
                      const int r1, const int g, float (&num)[EPL], float& den, float& M) {
  M = -INFINITY;
  for (int i = r0 + lane; i < r1; i += 32) M = fmaxf(M, qab_ldcg(mp + (base + i) * 2));
#pragma unroll
  for (int x = 16; x > 0; x >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, x));
  QAB_MARK(5);
  float* sw = sm + g * MCH;
  den = 0.f;
#pragma unroll
  for (int e = 0; e < EPL; ++e) num[e] = 0.f;
  for (int c0 = r0; c0 < r1; c0 += MCH) {
    const int c1 = min(c0 + MCH, r1);
    float dl = 0.f;
    for (int i = c0 + lane; i < c1; i += 32) {
      const float wi = exp2f(qab_ldcg(mp + (base + i) * 2) - M);
      sw[i - c0] = wi;
      dl += wi * qab_ldcg(mp + (base + i) * 2 + 1);
    }
    den += qab_warp_sum(dl);
    QAB_MARK(6);
    __syncwarp();
    for (int i0 = c0; i0 < c1; i0 += U) {
      float ov[U][EPL];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        qab_ldcg_f32<EPL>(op + (base + min(i0 + u, c1 - 1)) * D + lane * EPL, pvec, ov[u]);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const float wi = i0 + u < c1 ? sw[i0 + u - c0] : 0.f;  // a repeated row weighs 0
#pragma unroll
        for (int e = 0; e < EPL; ++e) num[e] += wi * ov[u][e];
      }
    }
    QAB_MARK(7);
    __syncwarp();  // the weights read before the next chunk overwrites them
  }
};
// The level-2 partials (PM): o2 [B, Hq, NG, D], ml2 [B, Hq, NG, 2] after ml.
float* o2 = ml + (size_t)gridDim.z * Hq * NB * 2;
float* ml2 = o2 + (size_t)gridDim.z * Hq * NG * D;
const float* fo = o_part;  // the final merge's rows: the key blocks', or the groups'
const float* fm = ml;
int fn = NBe, fnb = NB;
if (two) {
  // Level 1: this group's key blocks that hold keys into its level-2 row.
  const int qe = min(q1, NBe);
  for (int g = w; g < G; g += WARPS) {
    const int64_t hrow = (int64_t)b * Hq + h * G + g;
    float num[EPL], den, M;
    merge_rows(o_part, ml, hrow * NB, q0, qe, g, num, den, M);
    const int64_t prow = hrow * NG + j / GS;
    qab_store_f32<EPL>(o2 + prow * D + lane * EPL, pvec, num);
    if (lane == 0) {
      ml2[prow * 2] = M;
      ml2[prow * 2 + 1] = den;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    *gcnt = 0u;
    __threadfence();
    sm_last = atomicAdd(cnt, 1u) == static_cast<uint32_t>(NG - 1);
  }
  __syncthreads();
  if (!sm_last) {
    return;
  }
  __threadfence();
  // Level 2: the groups that hold keys.
  fo = o2;
  fm = ml2;
  fn = (NBe + GS - 1) / GS;
  fnb = NG;
}
for (int g = w; g < G; g += WARPS) {
  const int hq = h * G + g;
  float num[EPL], den, M;
  merge_rows(fo, fm, ((int64_t)b * Hq + hq) * fnb, 0, fn, g, num, den, M);
#pragma unroll
  for (int e = 0; e < EPL; ++e) {
    const int d = lane * EPL + e;
    const InT y = static_cast<InT>(num[e] / den);
    out[((int64_t)b * Hq + hq) * D + d] =
        qab_sigmoid_gate<InT>(y, static_cast<float>(row[(int64_t)(hq * 2 * D + D + d) * es]));
  }
}
QAB_MARK(4);
if (threadIdx.x == 0) {
  const_cast<uint32_t*>(count)[(int64_t)b * Hk + h] = 0u;
}
