// One row of MoE routing as the stock GPU route computes it: softmax over the
// E router logits (float32, rounded to InT), the K largest probabilities, and
// (NORM) their renormalisation, by ONE warp. Shared by moe_router_topk.cu (a
// warp per row of logits in global memory) and moe_add_norm_route.cu (the
// block's own logits in shared memory). The arithmetic and why it matches
// MLX's kernels are described in moe_router_topk.cu.
//
// x: the row's E logits (any address space the warp can read); lane: this
// thread's lane; inds, scores: the row's K outputs (slot K - 1 holds the
// largest probability). Every lane of the warp must call it.

// The bits of a 16-bit float (half or bfloat16), and back.
template <typename T16>
__device__ __forceinline__ unsigned short qab_bits16(const T16 x) {
  static_assert(sizeof(T16) == 2, "qab_bits16: a 16-bit type");
  return *reinterpret_cast<const unsigned short*>(&x);
}
template <typename T16>
__device__ __forceinline__ T16 qab_from_bits16(const unsigned short bits) {
  static_assert(sizeof(T16) == 2, "qab_from_bits16: a 16-bit type");
  T16 x;
  *reinterpret_cast<unsigned short*>(&x) = bits;
  return x;
}

template <typename InT, int E, int K, bool NORM>
__device__ __forceinline__ void qab_route_row(const InT* x, const int lane, uint32_t* inds,
                                              InT* scores) {
  constexpr int VEC = 16 / int(sizeof(InT));
  constexpr int NG = (E + 32 * VEC - 1) / (32 * VEC);  // 32-thread groups of MLX's softmax
  constexpr int PER = NG * VEC;                       // elements per lane
  static_assert(E >= 1 && E <= 1024, "qab_route_row: 1 <= E <= 1024");
  static_assert(K >= 1 && K <= E && K <= 32, "qab_route_row: 1 <= K <= min(E, 32)");

  const float NEG_INF = __uint_as_float(0xff800000u);
  const float POS_INF = __uint_as_float(0x7f800000u);
  const float TAKEN = -2.0f;  // below every probability and the empty-lane key -1

  // Lane `lane` of group g holds experts VEC * (32 g + lane) + j, j < VEC.
  float v[PER];
  #pragma unroll
  for (int g = 0; g < NG; ++g) {
  #pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const int e = VEC * (32 * g + lane) + j;
      v[g * VEC + j] = e < E ? static_cast<float>(x[e]) : NEG_INF;
    }
  }

  // Softmax statistics, group by group (MLX: one 32-thread warp each).
  float gmax[NG], gsum[NG];
  #pragma unroll
  for (int g = 0; g < NG; ++g) {
    float m = -3.402823466e+38f;  // MLX's finite_min start
  #pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float t = v[g * VEC + j];
      m = m > t ? m : t;
    }
    float s = 0.0f;
  #pragma unroll
    for (int j = 0; j < VEC; ++j) {
      s = s + __expf(v[g * VEC + j] - m);
    }
    float gm = m;
  #pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float t = __shfl_xor_sync(0xffffffffu, gm, o);
      gm = gm > t ? gm : t;
    }
    s = s * __expf(m - gm);
  #pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      s = s + __shfl_xor_sync(0xffffffffu, s, o);
    }
    gmax[g] = gm;
    gsum[g] = s;
  }
  float rmax = gmax[0];
  #pragma unroll
  for (int g = 1; g < NG; ++g) {
    rmax = rmax > gmax[g] ? rmax : gmax[g];
  }
  // The groups' sums, rescaled to the row max, added as MLX's second butterfly
  // adds them: lane g holds group g's, the other lanes 0.
  float total = 0.0f;
  #pragma unroll
  for (int g = 0; g < NG; ++g) {
    if (lane == g) {
      total = gsum[g] * __expf(gmax[g] - rmax);
    }
  }
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    total = total + __shfl_xor_sync(0xffffffffu, total, o);
  }
  const float inv = 1.0f / total;

  // K rounds of a warp argmax over (rounded probability, expert); round r
  // finds the r-th largest (ties: the larger expert index), which lane r keeps
  // (slot K - 1 - r). NaN ranks above every number and comes back as NaN.
  float mine = 0.0f;
  int mine_e = 0;
  if constexpr (sizeof(InT) == 2) {
    // A 16-bit probability and the expert index pack into one uint32 whose
    // unsigned order is the (probability, expert) order (non-negative halves
    // and bfloat16s order as their bits; +inf stands for NaN): a round is a
    // lane max and one warp max (redux.sync; a butterfly before sm_80). 0 marks
    // padding and taken ones. (+inf shares NaN's key, as in the float path.)
    const unsigned short INF_BITS = qab_bits16(static_cast<InT>(POS_INF));
    uint32_t key[PER];
  #pragma unroll
    for (int k = 0; k < PER; ++k) {
      const int e = VEC * (32 * (k / VEC) + lane) + k % VEC;
      const InT p = static_cast<InT>(__expf(v[k] - rmax) * inv);
      const float pf = static_cast<float>(p);
      const unsigned short bits = pf != pf ? INF_BITS : qab_bits16(p);
      key[k] = e < E ? ((static_cast<uint32_t>(bits) << 16) | static_cast<uint32_t>(e)) + 1u : 0u;
    }
  #pragma unroll 1
    for (int r = 0; r < K; ++r) {
      uint32_t best = 0u;
  #pragma unroll
      for (int k = 0; k < PER; ++k) {
        best = key[k] > best ? key[k] : best;
      }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  #pragma unroll
      for (int o = 16; o > 0; o >>= 1) {  // no redux.sync before sm_80
        const uint32_t t = __shfl_xor_sync(0xffffffffu, best, o);
        best = t > best ? t : best;
      }
#else
      best = __reduce_max_sync(0xffffffffu, best);
#endif
      if (lane == r) {
        const unsigned short bits = static_cast<unsigned short>((best - 1u) >> 16);
        const float bv = static_cast<float>(qab_from_bits16<InT>(bits));
        mine = bits == INF_BITS ? __uint_as_float(0x7fc00000u) : bv;  // NaN back
        mine_e = static_cast<int>((best - 1u) & 0xffffu);
      }
  #pragma unroll
      for (int k = 0; k < PER; ++k) {
        if (key[k] == best) {
          key[k] = 0u;
        }
      }
    }
  } else {
    // Rounded probabilities as selection keys (NaN ranks above every number).
    float key[PER];
  #pragma unroll
    for (int k = 0; k < PER; ++k) {
      const int e = VEC * (32 * (k / VEC) + lane) + k % VEC;
      const float p = static_cast<float>(static_cast<InT>(__expf(v[k] - rmax) * inv));
      key[k] = e < E ? (p != p ? POS_INF : p) : TAKEN;
    }
  #pragma unroll 1
    for (int r = 0; r < K; ++r) {
      float bv = -1.0f;
      int be = -1;
  #pragma unroll
      for (int k = 0; k < PER; ++k) {
        const int e = VEC * (32 * (k / VEC) + lane) + k % VEC;
        if (key[k] > bv || (key[k] == bv && e > be)) {
          bv = key[k];
          be = e;
        }
      }
  #pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oe = __shfl_xor_sync(0xffffffffu, be, o);
        if (ov > bv || (ov == bv && oe > be)) {
          bv = ov;
          be = oe;
        }
      }
      if (lane == r) {
        mine = bv == POS_INF ? __uint_as_float(0x7fc00000u) : bv;  // NaN back
        mine_e = be;
      }
  #pragma unroll
      for (int k = 0; k < PER; ++k) {
        const int e = VEC * (32 * (k / VEC) + lane) + k % VEC;
        if (e == be) {
          key[k] = TAKEN;
        }
      }
    }
  }

  InT score = static_cast<InT>(mine);
  if (NORM) {
    // MLX's row sum of the K slots: thread t adds slots VEC t .. VEC t + VEC - 1
    // in order (slot s is held by lane K - 1 - s), then a butterfly.
    InT part = static_cast<InT>(0.0f);
  #pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const int s = VEC * lane + j;
      const int src = s < K ? K - 1 - s : 0;
      const float t = __shfl_sync(0xffffffffu, mine, src);
      if (s < K) {
        part = part + static_cast<InT>(t);
      }
    }
  #pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      part = part + static_cast<InT>(__shfl_xor_sync(0xffffffffu, static_cast<float>(part), o));
    }
    score = score / part;
  }
  if (lane < K) {
    inds[K - 1 - lane] = static_cast<uint32_t>(mine_e);
    scores[K - 1 - lane] = score;
  }
}
