// moe_add_norm_route's work for one block: part `part` of the `nparts`
// blocks of token row n (the kernel moe_add_norm_route.cu, one block per
// (part, row), and the route phase of moe_decode_block.cu). Returns true in
// the block that counted last and routed the row. Arithmetic, layout and
// arguments: see moe_add_norm_route.cu. Needs common.cuh and moe_route_row.cuh.

// Phase 1 of the route for token row n, every thread of a BLOCK-thread block:
//   h[n] = T(x[n] + r[n]),  y[n] = T(nw * T(h[n] * rsqrt(mean(h[n]^2) + eps)))
// into a shared-memory copy of y[n] (returned; one buffer per instantiation,
// valid after the helper's closing barrier until the caller's next write to
// it), and into h, y when `write` (one block per row writes them). Each
// thread holds elements t + BLOCK j; the sum of squares: per thread, a warp
// butterfly, one partial per warp, every warp adding the partials in order.
// With RCG r is read through L2 (moe_decode_block.cu's OP phase wrote it in
// the same launch). Used by the route and by moe_decode_block.cu's EARLY gate/up items (which
// stage y themselves instead of waiting for the route to write it): the same
// code, so the same bits. x_of(j, i), nw_of(j, i): x[n, i] and nw[i] as float
// for the thread's element j (i = t + BLOCK j); eps_of(): eps. The two
// qab_add_norm_row forms below read them from memory there, or from registers
// loaded before (QabAddNormIn).
template <typename T, int D, int BLOCK, bool RCG, typename XF, typename NF, typename EF>
__device__ __forceinline__ const T* qab_add_norm_row_with(const size_t n, const XF x_of,
                                                          const T* r, const NF nw_of,
                                                          const EF eps_of, T* h, T* y,
                                                          const bool write) {
  constexpr int WARPS = BLOCK / 32;
  constexpr int PER = (D + BLOCK - 1) / BLOCK;
  __shared__ __align__(16) T ys[D];
  __shared__ float partial[WARPS];
  const int t = threadIdx.x;
  const int lane = t & 31;
  const int warp = t >> 5;
  const size_t base = n * D;
  float hv[PER];
  float rv[PER];
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    const int i = t + BLOCK * j;
    hv[j] = i < D ? x_of(j, i) : 0.f;
    rv[j] = i < D ? static_cast<float>(qab_ld<RCG>(r + base + i)) : 0.f;
  }
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    const int i = t + BLOCK * j;
    if (i < D) {
      const T hr = static_cast<T>(hv[j] + rv[j]);
      if (write) {
        h[base + i] = hr;
      }
      hv[j] = static_cast<float>(hr);
      ss += hv[j] * hv[j];
    }
  }
  ss = qab_warp_sum(ss);
  if (lane == 0) {
    partial[warp] = ss;
  }
  __syncthreads();
  float total = lane < WARPS ? partial[lane] : 0.f;
  total = qab_warp_sum(total);
  const float inv = rsqrtf(total / static_cast<float>(D) + eps_of());
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    const int i = t + BLOCK * j;
    if (i < D) {
      const float v = static_cast<float>(static_cast<T>(hv[j] * inv));
      const T yv = static_cast<T>(nw_of(j, i) * v);
      if (write) {
        y[base + i] = yv;
      }
      ys[i] = yv;
    }
  }
  __syncthreads();
  return ys;
}

// The inputs of qab_add_norm_row that do not depend on r (x[n], nw, eps),
// loaded into registers before a wait for r (moe_decode_block.cu's RPL
// builds): the same values, so the same bits, with their trips to memory
// overlapping the wait instead of following it.
template <typename T, int D, int BLOCK>
struct QabAddNormIn {
  static constexpr int PER = (D + BLOCK - 1) / BLOCK;
  float xv[PER];
  float nv[PER];
  float eps;
  __device__ __forceinline__ void load(const size_t n, const T* x, const T* nw,
                                       const float* epsp) {
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      const int i = threadIdx.x + BLOCK * j;
      xv[j] = i < D ? static_cast<float>(x[n * D + i]) : 0.f;
      nv[j] = i < D ? static_cast<float>(nw[i]) : 0.f;
    }
    eps = epsp[0];
  }
};

template <typename T, int D, int BLOCK, bool RCG = false>
__device__ __forceinline__ const T* qab_add_norm_row(const size_t n, const T* x, const T* r,
                                                     const T* nw, const float* eps, T* h, T* y,
                                                     const bool write) {
  const size_t base = n * D;
  return qab_add_norm_row_with<T, D, BLOCK, RCG>(
      n, [&](const int, const int i) { return static_cast<float>(x[base + i]); }, r,
      [&](const int, const int i) { return static_cast<float>(nw[i]); },
      [&]() { return eps[0]; }, h, y, write);
}

// qab_add_norm_row over inputs loaded before (QabAddNormIn::load).
template <typename T, int D, int BLOCK, bool RCG = false>
__device__ __forceinline__ const T* qab_add_norm_row(const size_t n,
                                                     const QabAddNormIn<T, D, BLOCK>& in,
                                                     const T* r, T* h, T* y, const bool write) {
  return qab_add_norm_row_with<T, D, BLOCK, RCG>(
      n, [&](const int j, const int) { return in.xv[j]; }, r,
      [&](const int j, const int) { return in.nv[j]; }, [&]() { return in.eps; }, h, y, write);
}

// PRE: x[n], nw and eps are loaded with the router weights, before `wait`
// (QabAddNormIn; the same bits). RESET: the block that routes the row resets
// count[n] to 0; without it count[n] stays at nparts for the launch's other
// blocks to read (moe_decode_block.cu's GSR gate/up items wait on it) and the
// caller resets it.
template <typename T, int D, int E, int K, int G, bool NORM, int BLOCK, int RB, bool RCG = false,
          bool PRE = false, bool RESET = true, bool ROLL = false, typename Wait = QabNoWait,
          typename Counted = QabNoWait>
__device__ __forceinline__ bool qab_add_norm_route_part(
    const int part, const int nparts, const size_t n, const T* x, const T* r, const T* nw,
    const float* eps, const uint32_t* gw, const T* gs, const T* gb, const uint32_t* count, T* h,
    T* y, T* logits, uint32_t* inds, T* scores, Wait wait = Wait(),
    Counted counted = Counted()) {
  static_assert(sizeof(T) == 2, "moe_add_norm_route: T is bfloat16 or float16");
  static_assert(D % 256 == 0, "moe_add_norm_route: D % 256 == 0 (no residue step)");
  static_assert(G % 8 == 0 && D % G == 0, "moe_add_norm_route: a lane's 8 weights share a group");
  constexpr int WARPS = BLOCK / 32;
  constexpr int EPT = 8;                 // weights per lane and step (MLX's qmv for 8 bits)
  constexpr int STEPS = D / (32 * EPT);  // steps per row
  constexpr int GPR = D / G;             // quantization groups per row
  constexpr int EPB = WARPS * RB;        // experts per block
  __shared__ T ls[E];
  __shared__ bool last;

  const int t = threadIdx.x;
  const int lane = t & 31;
  const int warp = t >> 5;

  // This block's router weights, scales and biases: loaded first, so that their
  // trip to memory overlaps phase 1 (they do not depend on it).
  const uint8_t* wq = reinterpret_cast<const uint8_t*>(gw);
  const int e0 = part * EPB + warp * RB;
  uint2 q[RB][STEPS];
  float qs[RB][STEPS];
  float qb[RB][STEPS];
#pragma unroll
  for (int b = 0; b < RB; ++b) {
    const int e = e0 + b < E ? e0 + b : E - 1;  // a padding row re-reads the last
#pragma unroll
    for (int s = 0; s < STEPS; ++s) {
      const int idx = lane * EPT + s * 32 * EPT;
      q[b][s] = *reinterpret_cast<const uint2*>(wq + (size_t)e * D + idx);
      qs[b][s] = static_cast<float>(gs[(size_t)e * GPR + idx / G]);
      qb[b][s] = static_cast<float>(gb[(size_t)e * GPR + idx / G]);
    }
  }

  QabAddNormIn<T, D, BLOCK> in;
  if constexpr (PRE) {
    in.load(n, x, nw, eps);
  }
  if constexpr (!QabIsNoWait<Wait>::value) {
    qab_pin_loads(q, qs, qb);  // (profiling builds with QAB_PIN_LOADS only)
  }
  // `wait` (every thread; it may hold a block barrier) until r is written
  // (moe_decode_block.cu's OP: another block of the launch writes it, read
  // through L2 with RCG).
  wait();

  // Phase 1: h = x + r, y = rms_norm(h) * nw (every block; block 0 writes them).
  const T* ys;
  if constexpr (PRE) {
    ys = qab_add_norm_row<T, D, BLOCK, RCG>(n, in, r, h, y, part == 0);
  } else {
    ys = qab_add_norm_row<T, D, BLOCK, RCG>(n, x, r, nw, eps, h, y, part == 0);
  }
  QAB_SUBMARK(5);  // (profiling builds: h and y formed)

  // Phase 2: this block's router logits, RB expert rows per warp.
  {
#pragma unroll
    for (int b = 0; b < RB; ++b) {
      const int e = e0 + b < E ? e0 + b : E - 1;
      float sums[EPT];
#pragma unroll
      for (int i = 0; i < EPT; ++i) {
        sums[i] = 0.f;
      }
      // Step s's EPT weights of row b, its loads at [b][ss] (ss == s, or 0 rolled).
      auto step = [&](const int s, const int ss) {
        const int idx = lane * EPT + s * 32 * EPT;
        const float sc = qs[b][ss];
        const float bi = qb[b][ss];
        const QabVec<T, EPT> yv = *reinterpret_cast<const QabVec<T, EPT>*>(ys + idx);
        const uint32_t words[2] = {q[b][ss].x, q[b][ss].y};
#pragma unroll
        for (int i = 0; i < EPT; ++i) {
          const float qv = qab_byte(words[i / 4], 8 * (i % 4));
          const float wd = static_cast<float>(
              static_cast<T>(static_cast<float>(static_cast<T>(qv * sc)) + bi));
          sums[i] = fmaf(static_cast<float>(yv.v[i]), wd, sums[i]);
        }
      };
      // (ROLL: one step's code in a loop, common.cuh's qab_dot_loop.)
      qab_dot_loop<STEPS, ROLL>(step, [&]() { qab_shift_down(q[b], qs[b], qb[b]); });
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < EPT; ++i) {
        sum += sums[i];
      }
      sum = qab_warp_sum(sum);
      if (lane == 0 && e0 + b < E) {
        logits[n * E + e] = static_cast<T>(sum);
      }
    }
  }

  // Phase 3: the block that finishes the row last routes it.
  QAB_SUBMARK(6);  // (profiling builds: thread 0's logits written)
  __threadfence();
  QAB_SUBMARK(7);  // (profiling builds: thread 0's fence done)
  __syncthreads();
  if (t == 0) {
    const unsigned int prev = atomicAdd(const_cast<uint32_t*>(count) + n, 1u);
    last = prev == nparts - 1;
  }
  __syncthreads();
  // `counted` (every thread): this block's logits are written and counted
  // (moe_decode_block.cu's profiling builds mark the time here).
  counted();
  if (!last) {
    return false;
  }
  __threadfence();
  for (int e = t; e < E; e += BLOCK) {
    ls[e] = qab_ldcg(logits + n * E + e);
  }
  __syncthreads();
  QAB_SUBMARK(8);  // (profiling builds: the row's logits read back)
  if (warp == 0) {
    qab_route_row<T, E, K, NORM>(ls, lane, inds + n * K, scores + n * K);
  }
  if (RESET && t == 0) {
    const_cast<uint32_t*>(count)[n] = 0u;
  }
  return true;
}
