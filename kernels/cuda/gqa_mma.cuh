// The tensor-core split-K decode attention pass over one thread block's key
// block (gqa_decode_step.cu's MMA build): the same (m, l, o) per query head
// as gqa_lanes.cuh's qab_lanes_block, computed with mma.sync instead of
// per-lane float32 dot products. Flash-decoding (Dao et al., 2023) with the
// G <= 8 query heads of a KV head packed into one mma operand.
//
// Why: the lane-group pass spends ~2,000 float32 FMAs per key (G = 8 heads x
// D = 256 for q k, as many for p v) plus a shared-memory load of q per 4 of
// them; at the 8 warps per SM its registers allow it was issue-bound (on the
// H200, Qwen3.6 at 4K keys: 12-16 us per pass, 0.2 instructions per cycle per
// scheduler, under 5 % of DRAM bandwidth). Here a warp's 8 keys take 2 D / 16
// + 2 D / 16 mma instructions.
//
// Per warp and step of 8 keys t0 .. t0 + 7 (lane = 4 r + t):
//   S = q K^T: m16n8k16, A = the query rows (row r = head r, rows 8..15 zero),
//     B = K^T (column n = key t0 + n). The dot product's order over d is free,
//     so the k index of mma 2 p + c maps to the head dims 32 p + 8 t' + 4 c +
//     {0, 1, 2, 3} of the lane t' holding it: each lane loads its K row (key
//     t0 + r) and its query row (head r) as 16-byte pieces, dims 32 p + 8 t ..
//     + 7, and hands words 0, 1 to mma 2 p and words 2, 3 to mma 2 p + 1.
//     The lane's results: S[head r][keys 2 t, 2 t + 1].
//   Online softmax per head r over the step (a max over the 4 lanes of the
//     group, exp2 of scores already in log2 units).
//   O^T += V^T P^T: m16n8k8, A = V^T (row = head dim, k = key), B = P^T (k =
//     key 2 t, 2 t + 1, n = head r): exactly this lane's two probabilities, so
//     no exchange. P is split into a bf16 / f16 high part and the rounded
//     rest, two mma each (P to ~16 bits: the sum stays within float32-level
//     error of the lane-group pass's float32 p v). A's rows for mma i are the
//     dims (D / 8) r + i and (D / 8) r + D / 16 + i: each lane loads dims
//     (D / 8) r .. + D / 8 of its 2 V rows (keys t0 + 2 t, t0 + 2 t + 1) as
//     16-byte pieces and pairs them with byte permutes.
// The lane's o: o[4 i + c], i < D / 16: c = 0 / 1: heads 2 t / 2 t + 1 at dim
// (D / 8) r + i; c = 2 / 3: the same heads at dim (D / 8) r + D / 16 + i. Its
// m and l: head r (the 4 lanes of group r hold the same values).
//
// Requires InT bf16 or f16, D a multiple of 64 up to 256, K and V rows
// contiguous along the head dim with rows 16-byte aligned (the caller checks;
// gqa_decode_step.cu runs the lane-group pass otherwise), and the query rows
// staged as InT [8][D] in shared memory `sq` (16-byte aligned; rows past the
// G heads zero). Shared arrays as qab_lanes_block's, sized for 8 heads:
// sm (WARPS / 2) * 8 * D floats, sm_m and sm_l WARPS * 8 floats. Every thread
// of the block must call it (it has barriers). On return warp 0 holds the
// block's (m, l, o) (every warp's m is the block's max per head).

// Whether InT is half (f16 mma) rather than bf16 (no <type_traits> in the JIT).
template <typename T>
struct QabIsHalf {
  static constexpr bool value = false;
};
template <>
struct QabIsHalf<__half> {
  static constexpr bool value = true;
};

template <typename InT>
__device__ __forceinline__ void qab_mma_16816(float (&d)[4], const uint32_t a0, const uint32_t a1,
                                              const uint32_t a2, const uint32_t a3,
                                              const uint32_t b0, const uint32_t b1) {
  if constexpr (QabIsHalf<InT>::value) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

template <typename InT>
__device__ __forceinline__ void qab_mma_1688(float* d, const uint32_t a0, const uint32_t a1,
                                             const uint32_t b0) {
  if constexpr (QabIsHalf<InT>::value) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(b0));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(b0));
  }
}

// Two floats as InT x 2 in one word (x in the low half): their rounding, and
// the rest x - round(x) rounded again (hi + lo carries ~16 bits of x).
template <typename InT>
__device__ __forceinline__ void qab_pack2_split(const float x, const float y, uint32_t& hi,
                                                uint32_t& lo) {
  const InT hx = static_cast<InT>(x), hy = static_cast<InT>(y);
  const InT lx = static_cast<InT>(x - static_cast<float>(hx));
  const InT ly = static_cast<InT>(y - static_cast<float>(hy));
  hi = static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(&hx)) |
       (static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(&hy)) << 16);
  lo = static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(&lx)) |
       (static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(&ly)) << 16);
}

// A lane's o (qab_mma_block's layout) times c0 for head 2 t, c1 for head 2 t + 1.
template <int D>
__device__ __forceinline__ void qab_mma_scale_o(float (&o)[D / 4], const float c0,
                                                const float c1) {
#pragma unroll
  for (int i = 0; i < D / 16; ++i) {
    o[4 * i] *= c0;
    o[4 * i + 1] *= c1;
    o[4 * i + 2] *= c0;
    o[4 * i + 3] *= c1;
  }
}

template <typename InT, int D, int WARPS>
__device__ __forceinline__ void qab_mma_block(const InT* sq, float* sm, float* sm_m, float* sm_l,
                                              const InT* k0, const int64_t ks, const InT* v0,
                                              const int64_t vs, const int s0, const int s1,
                                              const float qscale, float& m, float& l,
                                              float (&o)[D / 4]) {
  constexpr int KC = D / 32;  // 16-byte K / q pieces per lane (2 mma of k16 each)
  constexpr int DV = D / 8;   // V dims per lane and key row
  constexpr int NI = D / 16;  // p v mma per step
  static_assert(D % 64 == 0 && D <= 256, "D must be a multiple of 64, at most 256");
  static_assert(sizeof(InT) == 2, "16-bit inputs only");
  static_assert(WARPS == 1 || WARPS == 2 || WARPS == 4 || WARPS == 8 || WARPS == 16,
                "WARPS must be 1, 2, 4, 8 or 16");
  const int lane = threadIdx.x & 31;
  const int w = threadIdx.x >> 5;
  const int r = lane >> 2;
  const int t = lane & 3;
  uint32_t qf[KC][4];
#pragma unroll
  for (int p = 0; p < KC; ++p) {
    const uint4 u = *reinterpret_cast<const uint4*>(sq + r * D + 32 * p + 8 * t);
    qf[p][0] = u.x;
    qf[p][1] = u.y;
    qf[p][2] = u.z;
    qf[p][3] = u.w;
  }
  m = -INFINITY;
  l = 0.f;
#pragma unroll
  for (int e = 0; e < D / 4; ++e) o[e] = 0.f;

  for (int t0 = s0 + w * 8; t0 < s1; t0 += WARPS * 8) {
    // Loads first: this lane's K row piece and its two V rows (a key past the
    // block repeats the last row; its probability is 0).
    const InT* kr = k0 + (int64_t)min(t0 + r, s1 - 1) * ks + 8 * t;
    uint4 kv[KC];
#pragma unroll
    for (int p = 0; p < KC; ++p) kv[p] = *reinterpret_cast<const uint4*>(kr + 32 * p);
    const InT* va = v0 + (int64_t)min(t0 + 2 * t, s1 - 1) * vs + DV * r;
    const InT* vb = v0 + (int64_t)min(t0 + 2 * t + 1, s1 - 1) * vs + DV * r;
    uint32_t wa[DV / 2], wb[DV / 2];
#pragma unroll
    for (int c = 0; c < DV / 8; ++c) {
      *reinterpret_cast<uint4*>(wa + 4 * c) = *reinterpret_cast<const uint4*>(va + 8 * c);
      *reinterpret_cast<uint4*>(wb + 4 * c) = *reinterpret_cast<const uint4*>(vb + 8 * c);
    }
    // Scores S[head r][keys 2 t, 2 t + 1].
    float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int p = 0; p < KC; ++p) {
      qab_mma_16816<InT>(s, qf[p][0], 0u, qf[p][1], 0u, kv[p].x, kv[p].y);
      qab_mma_16816<InT>(s, qf[p][2], 0u, qf[p][3], 0u, kv[p].z, kv[p].w);
    }
    const float x0 = t0 + 2 * t < s1 ? s[0] * qscale : -INFINITY;
    const float x1 = t0 + 2 * t + 1 < s1 ? s[1] * qscale : -INFINITY;
    float mt = fmaxf(x0, x1);
    mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 1));
    mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 2));
    const float mn = fmaxf(m, mt);  // finite: key t0 is in the block
    const float corr = exp2f(m - mn);  // 0 while m is -inf
    m = mn;
    const float p0 = exp2f(x0 - mn), p1 = exp2f(x1 - mn);
    l = l * corr + (p0 + p1);
    // o holds heads 2 t and 2 t + 1: their groups' rescale factors.
    const float c0 = __shfl_sync(0xffffffffu, corr, 8 * t);
    const float c1 = __shfl_sync(0xffffffffu, corr, 8 * t + 4);
    qab_mma_scale_o<D>(o, c0, c1);
    uint32_t phi, plo;
    qab_pack2_split<InT>(p0, p1, phi, plo);
#pragma unroll
    for (int i = 0; i < NI; ++i) {
      // V^T rows (D / 8) r + i and + D / 16: element i / i + D / 16 of each V row.
      constexpr unsigned LO = 0x5410u, HI = 0x7632u;
      const int e0 = i, e1 = i + D / 16;
      const uint32_t a0 = __byte_perm(wa[e0 / 2], wb[e0 / 2], (e0 & 1) ? HI : LO);
      const uint32_t a1 = __byte_perm(wa[e1 / 2], wb[e1 / 2], (e1 & 1) ? HI : LO);
      qab_mma_1688<InT>(o + 4 * i, a0, a1, phi);
      qab_mma_1688<InT>(o + 4 * i, a0, a1, plo);
    }
  }
  // l over the group's 4 lanes (each summed its own two keys per step).
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  if (WARPS > 1) {
    // The block's max per head; every warp scales its l and o to it.
    if (t == 0) sm_m[w * 8 + r] = m;
    __syncthreads();
    float mb = -INFINITY, mb0 = -INFINITY, mb1 = -INFINITY;
#pragma unroll
    for (int i = 0; i < WARPS; ++i) {
      mb = fmaxf(mb, sm_m[i * 8 + r]);
      mb0 = fmaxf(mb0, sm_m[i * 8 + 2 * t]);
      mb1 = fmaxf(mb1, sm_m[i * 8 + 2 * t + 1]);
    }
    const float m0 = sm_m[w * 8 + 2 * t], m1 = sm_m[w * 8 + 2 * t + 1];
    const float c0 = m0 == -INFINITY ? 0.f : exp2f(m0 - mb0);
    const float c1 = m1 == -INFINITY ? 0.f : exp2f(m1 - mb1);
    l *= m == -INFINITY ? 0.f : exp2f(m - mb);
    m = mb;
    qab_mma_scale_o<D>(o, c0, c1);
    if (t == 0) sm_l[w * 8 + r] = l;
    // Tree: warps n / 2 .. n - 1 hand their o to warps 0 .. n / 2 - 1 (word e *
    // 32 + lane of a warp's slot: every warp holds the same layout).
#pragma unroll
    for (int n = WARPS; n > 1; n >>= 1) {
      const int half = n >> 1;
      if (w >= half && w < n) {
        float* slot = sm + (w - half) * (8 * D);
#pragma unroll
        for (int e = 0; e < D / 4; ++e) slot[e * 32 + lane] = o[e];
      }
      __syncthreads();
      if (w < half) {
        const float* slot = sm + w * (8 * D);
#pragma unroll
        for (int e = 0; e < D / 4; ++e) o[e] += slot[e * 32 + lane];
      }
      __syncthreads();
    }
    float lb = 0.f;
    for (int i = 0; i < WARPS; ++i) lb += sm_l[i * 8 + r];
    l = lb;
  }
}

// Warp 0's block partial to o_part / ml (the rows of heads g < G of this KV
// head, block j), from qab_mma_block's layout: head 2 t / 2 t + 1, dims (D /
// 8) r .. + D / 8, as 16-byte stores when vec (o_part 16-byte aligned); m and
// l of head r from lane 4 r.
template <int D, int G>
__device__ __forceinline__ void qab_mma_store_partial(const float (&o)[D / 4], const float m,
                                                      const float l, float* o_part, float* ml,
                                                      const int64_t row0, const int NB,
                                                      const bool vec) {
  const int lane = threadIdx.x & 31;
  const int r = lane >> 2;
  const int t = lane & 3;
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    const int hh = 2 * t + c;
    if (hh < G) {
      float* dst = o_part + (row0 + (int64_t)hh * NB) * D + (D / 8) * r;
#pragma unroll
      for (int q = 0; q < D / 32; ++q) {
        // dims 4 q .. 4 q + 3 of the lane's D / 8: the first D / 16 from o[4 i + c],
        // the rest from o[4 i + 2 + c].
        float v[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = 4 * q + e;
          v[e] = i < D / 16 ? o[4 * i + c] : o[4 * (i - D / 16) + 2 + c];
        }
        qab_store_f32<4>(dst + 4 * q, vec, v);
      }
    }
  }
  if (t == 0 && r < G) {
    ml[(row0 + (int64_t)r * NB) * 2] = m;
    ml[(row0 + (int64_t)r * NB) * 2 + 1] = l;
  }
}
