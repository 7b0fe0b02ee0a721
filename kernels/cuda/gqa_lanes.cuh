// The lane-group split-K decode attention pass over one thread block's key
// block (gqa_decode_partial_lanes.cu, gqa_decode_step.cu; the algorithm and
// its layout are described there): WARPS warps, LPK lanes per key, the G
// query rows staged (scaled to log2 units, float32) in shared memory `sm` at
// qab_lanes_q_at<InT, D>(g, d). On return warp 0 holds the block's (m, l, o)
// per query head (every warp's m is the block's max; l and o are whole in
// warp 0 only). The caller's shared arrays: sm of qab_lanes_smem_floats<InT,
// D, G, WARPS>() floats (16-byte aligned; the merge reuses the query rows'
// memory), sm_m and sm_l of WARPS * G floats each. Every thread of the block
// must call it (it has barriers).
//
// k0 / v0: the (b, KV head) key and value rows (row 0, element 0); ks / kd /
// vs / vd: their element strides of a row and along the last axis (vector
// loads where the last axis is contiguous and the rows aligned, else scalar
// loads); mp / ms: the mask row and its stride (read only if HAS_MASK); keys
// [s0, s1) (none when s1 <= s0: m = -inf, l = 0, o = 0).

template <typename InT, int D>
__device__ __forceinline__ int qab_lanes_q_at(const int g, const int d) {
  // Query rows as float4 [G][Q4][NP]: a group's LPK lanes read LPK
  // consecutive float4 (no bank conflict).
  constexpr int CH = 16 / sizeof(InT);
  constexpr int NP = D / CH;
  constexpr int Q4 = CH / 4;
  const int p = d / CH, e = d - p * CH;
  return ((g * Q4 + e / 4) * NP + p) * 4 + (e & 3);
}

template <typename InT, int D, int G, int WARPS>
__host__ __device__ constexpr int qab_lanes_smem_floats() {
  return (WARPS > 1 ? WARPS / 2 : 1) * G * D > G * D ? (WARPS > 1 ? WARPS / 2 : 1) * G * D
                                                     : G * D;
}

template <typename InT, int D, int G, int LPK, int WARPS, bool HAS_MASK>
__device__ __forceinline__ void qab_lanes_block(
    float* sm, float* sm_m, float* sm_l, const InT* k0, const int64_t ks, const int64_t kd,
    const InT* v0, const int64_t vs, const int64_t vd, const bool* mp, const int64_t ms,
    const int s0, const int s1, float (&m)[G], float (&l)[G], float (&o)[G][D / 32]) {
  constexpr int EPL = D / 32;                  // o elements per lane
  constexpr int CH = 16 / sizeof(InT);         // K elements per 16-byte piece
  constexpr int NP = D / CH;                   // K pieces per row
  constexpr int KP = NP / LPK;                 // K pieces per lane
  constexpr int KPS = 32 / LPK;                // keys per warp step
  constexpr int Q4 = CH / 4;                   // float4 of q per piece
  static_assert(D % 32 == 0 && EPL <= 8, "D must be a multiple of 32, at most 256");
  static_assert(LPK == 2 || LPK == 4 || LPK == 8 || LPK == 16 || LPK == 32,
                "LPK must be 2, 4, 8, 16 or 32");
  static_assert(NP % LPK == 0, "D must be a multiple of CH * LPK");
  static_assert(WARPS == 1 || WARPS == 2 || WARPS == 4 || WARPS == 8 || WARPS == 16,
                "WARPS must be 1, 2, 4, 8 or 16");
  static_assert(G >= 1 && G <= 16, "at most 16 query heads per KV head");
  const float4* qs4 = reinterpret_cast<const float4*>(sm);
  const int lane = threadIdx.x & 31;
  const int w = threadIdx.x >> 5;
  const int grp = lane / LPK;
  const int r = lane % LPK;
  // This lane's first K piece (r * CH elements in) and its EPL elements of V.
  const InT* kb = k0 + (int64_t)r * CH * kd;
  const InT* vp = v0 + (int64_t)lane * EPL * vd;
  constexpr int VA = alignof(QabVec<InT, EPL>) / sizeof(InT);  // elements per alignment unit
  const bool kvec = kd == 1 && ks % CH == 0 && qab_vec_aligned<InT, CH>(kb);
  const bool vvec = vd == 1 && vs % VA == 0 && qab_vec_aligned<InT, EPL>(vp);

#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int e = 0; e < EPL; ++e) o[g][e] = 0.f;
  }

  for (int t0 = s0 + w * KPS; t0 < s1; t0 += WARPS * KPS) {
    // Loads, all before any math: this group's K row, the step's V rows, the
    // mask byte. (Two steps' loads at once held more registers than a thread
    // has at the model's build: spills.)
    const int s = min(t0 + grp, s1 - 1);  // always a row of this block
    const InT* kr = kb + (int64_t)s * ks;
    QabVec<InT, CH> kc[KP];
#pragma unroll
    for (int c = 0; c < KP; ++c) {
      kc[c] = qab_load_vec<InT, CH>(kr + (int64_t)c * LPK * CH * kd, kd, kvec);
    }
    QabVec<InT, EPL> vr[KPS];
#pragma unroll
    for (int u = 0; u < KPS; ++u) {
      // A key past the block repeats the last row, with weight 0 (below).
      vr[u] = qab_load_vec<InT, EPL>(vp + (int64_t)min(t0 + u, s1 - 1) * vs, vd, vvec);
    }
    const bool ok = t0 + grp < s1 && (!HAS_MASK || mp[(int64_t)s * ms]);
    // Scores: this lane's pieces, then the group's tree.
    float kf[KP][CH];
#pragma unroll
    for (int c = 0; c < KP; ++c) {
#pragma unroll
      for (int e = 0; e < CH; ++e) kf[c][e] = static_cast<float>(kc[c].v[e]);
    }
    float acc[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      acc[g] = 0.f;
#pragma unroll
      for (int c = 0; c < KP; ++c) {
#pragma unroll
        for (int e4 = 0; e4 < Q4; ++e4) {
          const float4 qv = qs4[(g * Q4 + e4) * NP + c * LPK + r];
          acc[g] += qv.x * kf[c][4 * e4] + qv.y * kf[c][4 * e4 + 1] + qv.z * kf[c][4 * e4 + 2] +
                    qv.w * kf[c][4 * e4 + 3];
        }
      }
    }
#pragma unroll
    for (int x = 1; x < LPK; x <<= 1) {
#pragma unroll
      for (int g = 0; g < G; ++g) acc[g] += __shfl_xor_sync(0xffffffffu, acc[g], x);
    }
    // Online softmax over the step, per head.
    float p[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float sc = ok ? acc[g] : -INFINITY;
      float mt = sc;
#pragma unroll
      for (int x = LPK; x < 32; x <<= 1) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, x));
      const float mn = fmaxf(m[g], mt);
      if (mn == -INFINITY) {
        p[g] = 0.f;  // nothing allowed so far (warp-uniform)
        continue;
      }
      const float corr = exp2f(m[g] - mn);  // 0 while m is still -inf
      m[g] = mn;
      p[g] = exp2f(sc - mn);  // 0 for a masked key
      l[g] = l[g] * corr + p[g];
#pragma unroll
      for (int e = 0; e < EPL; ++e) o[g][e] *= corr;
    }
    // p v over the step's keys.
#pragma unroll
    for (int u = 0; u < KPS; ++u) {
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float pg = __shfl_sync(0xffffffffu, p[g], u * LPK);
#pragma unroll
        for (int e = 0; e < EPL; ++e) o[g][e] += pg * static_cast<float>(vr[u].v[e]);
      }
    }
  }
  // l over the warp's groups (the LPK lanes of a group hold the same sums).
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int x = LPK; x < 32; x <<= 1) l[g] += __shfl_xor_sync(0xffffffffu, l[g], x);
  }
  if (WARPS > 1) {
    // The block's max per head; every warp scales its l and o to it.
    if (lane == 0) {
#pragma unroll
      for (int g = 0; g < G; ++g) sm_m[w * G + g] = m[g];
    }
    __syncthreads();  // also: every warp is past its scores (the slots reuse q's memory)
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float mb = -INFINITY;
      for (int i = 0; i < WARPS; ++i) mb = fmaxf(mb, sm_m[i * G + g]);
      const float c = m[g] == -INFINITY ? 0.f : exp2f(m[g] - mb);
      m[g] = mb;
      l[g] *= c;
#pragma unroll
      for (int e = 0; e < EPL; ++e) o[g][e] *= c;
    }
    if (lane == 0) {
#pragma unroll
      for (int g = 0; g < G; ++g) sm_l[w * G + g] = l[g];
    }
    // Tree: warps n / 2 .. n - 1 hand their o to warps 0 .. n / 2 - 1 (element
    // e of lane i at slot word e * 32 + i of its head: no bank conflict).
#pragma unroll
    for (int n = WARPS; n > 1; n >>= 1) {
      const int half = n >> 1;
      if (w >= half && w < n) {
        float* slot = sm + (w - half) * (G * D);
#pragma unroll
        for (int g = 0; g < G; ++g) {
#pragma unroll
          for (int e = 0; e < EPL; ++e) slot[g * D + e * 32 + lane] = o[g][e];
        }
      }
      __syncthreads();
      if (w < half) {
        const float* slot = sm + w * (G * D);
#pragma unroll
        for (int g = 0; g < G; ++g) {
#pragma unroll
          for (int e = 0; e < EPL; ++e) o[g][e] += slot[g * D + e * 32 + lane];
        }
      }
      __syncthreads();
    }
    // The block's l: the warps' scaled sums in warp order.
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float lb = 0.f;
      for (int i = 0; i < WARPS; ++i) lb += sm_l[i * G + g];
      l[g] = lb;
    }
  }
}
