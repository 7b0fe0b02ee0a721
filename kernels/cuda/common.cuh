// Helpers shared by this package's CUDA kernel bodies.

__device__ __forceinline__ float qab_warp_sum(float x) {
  // Butterfly reduction: every lane ends with the warp's sum.
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    x += __shfl_xor_sync(0xffffffffu, x, o);
  }
  return x;
}

template <int W>
__device__ __forceinline__ float qab_group_sum(float x) {
  // Butterfly reduction over aligned groups of W lanes (W a power of two,
  // W <= 32); every lane of a group ends with the group's sum. The whole warp
  // must be converged.
#pragma unroll
  for (int o = W / 2; o > 0; o >>= 1) {
    x += __shfl_xor_sync(0xffffffffu, x, o);
  }
  return x;
}

__device__ __forceinline__ void qab_cp_async16(void* smem, const void* gmem) {
  // 16-byte asynchronous global -> shared copy (sm_80+), L2 only (.cg).
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}

__device__ __forceinline__ void qab_cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}

template <int N>
__device__ __forceinline__ void qab_cp_async_wait() {
  // Wait until at most N committed groups of this thread are still in flight.
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void qab_prefetch_l2(const void* p, uint32_t bytes) {
  // Asks the L2 to fetch [p, p + bytes) for a later read (a hint: nothing
  // returned, nothing to wait for). sm_90: one bulk prefetch (16-byte aligned
  // start and whole 16-byte units: the start is rounded down, the end up,
  // within the allocation's 256-byte granules); before it one
  // prefetch.global.L2 per 128-byte line.
#if __CUDA_ARCH__ >= 900
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  const uintptr_t lo = a & ~static_cast<uintptr_t>(15);
  const uint32_t n = static_cast<uint32_t>(((a + bytes + 15) & ~static_cast<uintptr_t>(15)) - lo);
  if (bytes != 0) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(lo), "r"(n) : "memory");
  }
#else
  for (uint32_t o = 0; o < bytes; o += 128) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(static_cast<const char*>(p) + o));
  }
#endif
}

// Bytes of an input of mx.fast.cuda_kernel from its shape arguments.
template <typename T, typename S>
__device__ __forceinline__ size_t qab_input_bytes(const T*, const S& shape, const int ndim) {
  size_t n = sizeof(T);
  for (int i = 0; i < ndim; ++i) {
    n *= static_cast<size_t>(shape[i]);
  }
  return n;
}

// Thread t of `nthreads` prefetches its share of [p, p + bytes) into L2:
// chunks of QAB_PREFETCH_CHUNK bytes, grid-stride.
constexpr uint32_t QAB_PREFETCH_CHUNK = 4096;
__device__ __forceinline__ void qab_prefetch_l2_share(const void* p, const size_t bytes,
                                                      const int t, const int nthreads) {
  const char* b = static_cast<const char*>(p);
  for (size_t o = static_cast<size_t>(t) * QAB_PREFETCH_CHUNK; o < bytes;
       o += static_cast<size_t>(nthreads) * QAB_PREFETCH_CHUNK) {
    const size_t left = bytes - o;
    qab_prefetch_l2(b + o, left < QAB_PREFETCH_CHUNK ? static_cast<uint32_t>(left)
                                                     : QAB_PREFETCH_CHUNK);
  }
}

constexpr int qab_vec_align(int elem, int n) {
  // Alignment of n contiguous elements of elem bytes read as one vector:
  // their size when it is a power of two (at most 16), 16 above, else elem.
  return n * elem >= 16 ? 16 : ((n * elem) & (n * elem - 1)) ? elem : n * elem;
}

template <typename T, int N>
struct alignas(qab_vec_align(sizeof(T), N)) QabVec {
  // N contiguous elements, loaded with vector instructions when aligned.
  T v[N];
};

template <typename T, int N>
__device__ __forceinline__ bool qab_vec_aligned(const T* p) {
  return reinterpret_cast<uintptr_t>(p) % alignof(QabVec<T, N>) == 0;
}

template <typename T, int N>
__device__ __forceinline__ QabVec<T, N> qab_load_vec(const T* p, int64_t stride, bool vec) {
  // Elements p[0], p[stride], ..., p[(N - 1) * stride]: one vector load when
  // vec (stride 1 and p aligned, see qab_vec_aligned), else N scalar loads.
  QabVec<T, N> r;
  if (vec) {
    r = *reinterpret_cast<const QabVec<T, N>*>(p);
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) r.v[e] = p[(int64_t)e * stride];
  }
  return r;
}

// A load through L2 only (ld.global.cg): after a __threadfence() that orders
// them, another block's writes are seen (this SM's L1 may hold none of them).
__device__ __forceinline__ float qab_ldcg(const float* p) { return __ldcg(p); }
__device__ __forceinline__ __nv_bfloat16 qab_ldcg(const __nv_bfloat16* p) {
  return __ushort_as_bfloat16(__ldcg(reinterpret_cast<const unsigned short*>(p)));
}
__device__ __forceinline__ __half qab_ldcg(const __half* p) {
  return __ushort_as_half(__ldcg(reinterpret_cast<const unsigned short*>(p)));
}
__device__ __forceinline__ uint32_t qab_ldcg(const uint32_t* p) { return __ldcg(p); }

// x[0] through L2 when CG (data another block of this launch wrote), else a
// plain load (data of earlier launches).
template <bool CG, typename T>
__device__ __forceinline__ T qab_ld(const T* p) {
  if constexpr (CG) {
    return qab_ldcg(p);
  } else {
    return *p;
  }
}

template <typename T, int N>
__device__ __forceinline__ QabVec<T, N> qab_load_vec_cg(const T* p, bool vec) {
  // qab_load_vec(p, 1, vec) through L2 (data another block of this launch
  // wrote): one 16-byte load when vec and the vector is 16 bytes, else N
  // scalar loads.
  QabVec<T, N> r;
  if constexpr (sizeof(QabVec<T, N>) == 16) {
    if (vec) {
      const uint4 u = __ldcg(reinterpret_cast<const uint4*>(p));
      r = *reinterpret_cast<const QabVec<T, N>*>(&u);
      return r;
    }
  }
#pragma unroll
  for (int e = 0; e < N; ++e) r.v[e] = qab_ldcg(p + e);
  return r;
}

// N float32 at p through L2 (data another block of this launch wrote): N / 4
// 16-byte loads when vec (N a multiple of 4, p 16-byte aligned), else N
// scalar loads; and the matching stores. The values are the same either way:
// only the number of load instructions (and L2 requests) differs.
template <int N>
__device__ __forceinline__ void qab_ldcg_f32(const float* p, bool vec, float (&r)[N]) {
  if constexpr (N % 4 == 0) {
    if (vec) {
#pragma unroll
      for (int i = 0; i < N / 4; ++i) {
        const float4 t = __ldcg(reinterpret_cast<const float4*>(p) + i);
        r[4 * i] = t.x;
        r[4 * i + 1] = t.y;
        r[4 * i + 2] = t.z;
        r[4 * i + 3] = t.w;
      }
      return;
    }
  }
#pragma unroll
  for (int e = 0; e < N; ++e) r[e] = qab_ldcg(p + e);
}

template <int N>
__device__ __forceinline__ void qab_store_f32(float* p, bool vec, const float (&r)[N]) {
  if constexpr (N % 4 == 0) {
    if (vec) {
#pragma unroll
      for (int i = 0; i < N / 4; ++i) {
        reinterpret_cast<float4*>(p)[i] = make_float4(r[4 * i], r[4 * i + 1], r[4 * i + 2],
                                                      r[4 * i + 3]);
      }
      return;
    }
  }
#pragma unroll
  for (int e = 0; e < N; ++e) p[e] = r[e];
}

// A phase mark of a ticketed kernel (moe_decode_block.cu): nothing, unless a
// profiling build defines it first (benchmarks/profile_moe_block_gpu.py
// records a timestamp per ticket and mark).
#ifndef QAB_MARK
#define QAB_MARK(k)
#endif

// A sub-step mark inside a ticketed item, where the helpers below (and the
// other headers) cannot see the kernel's ticket: nothing, unless a profiling
// build defines it first (benchmarks/profile_moe_block_gpu.py's MARK_DEFINE
// records thread 0's global timer as mark k, k >= 5, of the item its block
// runs). The shipped kernels' text is unchanged by these marks.
#ifndef QAB_SUBMARK
#define QAB_SUBMARK(k)
#endif

// Shifts register arrays down by one along their last index (a[..][j] =
// a[..][j + 1], the last element kept), for qab_dot_loop's rolled form: one
// array, an array of arrays (each row shifted), or several of either.
template <typename V, int N>
__device__ __forceinline__ void qab_shift_down(V (&a)[N]) {
#pragma unroll
  for (int j = 0; j + 1 < N; ++j) {
    a[j] = a[j + 1];
  }
}
template <typename V, int R, int N>
__device__ __forceinline__ void qab_shift_down(V (&a)[R][N]) {
#pragma unroll
  for (int r = 0; r < R; ++r) {
    qab_shift_down(a[r]);
  }
}
template <typename A, typename B, typename... More>
__device__ __forceinline__ void qab_shift_down(A& a, B& b, More&... more) {
  qab_shift_down(a);
  qab_shift_down(b, more...);
}

// A dot loop over N chunks whose loads sit in register arrays indexed by
// chunk (issued before the loop, e.g. before a wait): body(i, ii) computes
// chunk i from the arrays' element ii. Unrolled (ROLL false): body(i, i), N
// copies of the body's code. Rolled (moe_decode_block.cu's ROLL): one copy in
// a loop, body(i, 0) then shift() (qab_shift_down of each array), so that
// every array index stays a compile-time one and the arrays stay in
// registers: the same arithmetic in the same order, an N-th of the code for
// the SM's instruction cache (a phase's first block on an SM fetches it).
template <int N, bool ROLL, typename Body, typename Shift>
__device__ __forceinline__ void qab_dot_loop(const Body& body, const Shift& shift) {
  if constexpr (ROLL) {
#pragma unroll 1
    for (int i = 0; i < N; ++i) {
      body(i, 0);
      shift();
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      body(i, i);
    }
  }
}

// qab_wait_count's sleep between two polls, in ns (a profiling build may set it).
#ifndef QAB_WAIT_SLEEP_NS
#define QAB_WAIT_SLEEP_NS 32
#endif

// Nibble b of a 32-bit word of MLX's 4-bit layout (value b at bits 4b) as a
// float through a float's mantissa: OR 2^23's bits, then subtract 2^23 (two
// integer ops and one add; gemv_q4.cuh's dense dot, and qab_nibble in
// QAB_NIBBLE_MANTISSA builds). Exactly static_cast<float>((w >> 4b) & 15).
__device__ __forceinline__ float qab_nibble_mantissa(const uint32_t w, const int b) {
  return __uint_as_float(0x4B000000u | ((w >> (4 * b)) & 15u)) - 8388608.f;
}

// Nibble b of a 32-bit word of MLX's 4-bit layout (value b at bits 4b) as a
// float: an integer-to-float conversion. With QAB_NIBBLE_MANTISSA (profiling
// builds: profile_moe_block_gpu.py's MANT) qab_nibble_mantissa instead, on
// the integer and FP32 pipes rather than the conversion's, whose throughput
// on sm_90 is 16 per SM and clock: the same value, so the same
// bits, but measured no faster on an H100 in the MoE block's gate/up and down
// dots and the route (profile_layer_gpu.py: 78.5 against 76.7 us per Gated
// DeltaNet layer launch; the dots are not bound by the conversions).
__device__ __forceinline__ float qab_nibble(const uint32_t w, const int b) {
#ifdef QAB_NIBBLE_MANTISSA
  return qab_nibble_mantissa(w, b);
#else
  return static_cast<float>((w >> (4 * b)) & 15u);
#endif
}

// Bits [s, s + 8) of w (an 8-bit quantized weight, s <= 24) as a float, as
// qab_nibble makes it.
__device__ __forceinline__ float qab_byte(const uint32_t w, const int s) {
#ifdef QAB_NIBBLE_MANTISSA
  return __uint_as_float(0x4B000000u | ((w >> s) & 255u)) - 8388608.f;
#else
  return static_cast<float>((w >> s) & 255u);
#endif
}

// QAB_Q4_PRESCALE builds: a 4-bit dot's inputs carry the factor
// qab_q4_prescale(b) of their value's place b in the weight word (2^-4b for
// b < 5, 2^-4(b - 5) above), and qab_nibble_placed(w, w >> 20, b) is the
// nibble times its inverse, masked in place instead of shifted: the product
// is the same (both scalings exact but for inputs within 2^16 of the
// subnormals), so the same bits, with one integer op per value instead of two
// (plus one shift per word). Used by gemv_q4.cuh, moe_gate_up_shared.cuh and
// moe_down_shared.cuh; in the last two it also replaces qab_nibble's
// integer-to-float conversion (the mantissa, as QAB_NIBBLE_MANTISSA builds).
#ifdef QAB_Q4_PRESCALE
constexpr bool QAB_Q4_PS = true;
#else
constexpr bool QAB_Q4_PS = false;
#endif
__device__ __forceinline__ constexpr float qab_q4_prescale(const int b) {
  return b == 0 || b == 5 ? 1.f : b == 1 || b == 6 ? 0.0625f : b == 2 || b == 7 ? 0.00390625f
         : b == 3 ? 0.000244140625f : 0.0000152587890625f;
}
__device__ __forceinline__ float qab_nibble_placed(const uint32_t w, const uint32_t hi,
                                                   const int b) {
  const uint32_t m = b < 5 ? (w & (15u << (4 * b))) : (hi & (15u << (4 * (b - 5))));
  return __uint_as_float(0x4B000000u | m) - 8388608.f;
}

// One 32-value chunk of a 4-bit row: the 4 words' values (value b of word q
// at bits 4b) dotted with xv in the order (q, b) = (0, 0), (0, 1), ...
// Values become floats by qab_nibble_placed (PS: xv prescaled, qab_q4_prescale),
// else qab_nibble_mantissa (MANT) or qab_nibble. gemv_q4.cuh's qab_q4_dot32
// (MANT) and the experts' gate/up and down dots (moe_gate_up_shared.cuh,
// moe_down_shared.cuh) use it.
template <bool PS, bool MANT>
__device__ __forceinline__ float qab_q4_words_dot(const uint32_t (&words)[4],
                                                  const float (&xv)[32]) {
  float d = 0.f;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const uint32_t hi = words[q] >> 20;
#pragma unroll
    for (int b = 0; b < 8; ++b) {
      const float qv = PS ? qab_nibble_placed(words[q], hi, b)
                          : MANT ? qab_nibble_mantissa(words[q], b) : qab_nibble(words[q], b);
      d = fmaf(qv, xv[q * 8 + b], d);
    }
  }
  return d;
}

// xv[j] *= qab_q4_prescale(j % 8): a chunk's 32 inputs prescaled in registers
// for qab_q4_words_dot's PS (the experts' dots; gemv_q4.cuh prescales as it stages).
__device__ __forceinline__ void qab_q4_prescale32(float (&xv)[32]) {
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    xv[j] *= qab_q4_prescale(j & 7);
  }
}

// A compile-time phase number as a type (moe_decode_block.cu's run_item(QabPhase<P>{})).
template <int P>
struct QabPhase {
  static constexpr int value = P;
};

// A wait that returns at once: the default of a device function's optional
// wait step (qab_moe_down_shared_rows).
struct QabNoWait {
  __device__ __forceinline__ void operator()() const {}
};

// Whether a wait step is QabNoWait (a call that waits for nothing).
template <typename W>
struct QabIsNoWait {
  static constexpr bool value = false;
};
template <>
struct QabIsNoWait<QabNoWait> {
  static constexpr bool value = true;
};

// The xor of a loaded value's 32-bit words into x (qab_pin_loads).
__device__ __forceinline__ void qab_pin_xor(uint32_t& x, const float v) {
  x ^= __float_as_uint(v);
}
__device__ __forceinline__ void qab_pin_xor(uint32_t& x, const uint2 v) {
  x ^= v.x ^ v.y;
}
__device__ __forceinline__ void qab_pin_xor(uint32_t& x, const uint4 v) {
  x ^= v.x ^ v.y ^ v.z ^ v.w;
}
template <typename V, int N>
__device__ __forceinline__ void qab_pin_xor(uint32_t& x, const V (&a)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    qab_pin_xor(x, a[i]);
  }
}

// Profiling builds with QAB_PIN_LOADS (benchmarks/profile_layer_gpu.py's PIN):
// uses every loaded value of `vs` (register arrays of floats, uint2 or uint4)
// before a wait, so that the loads are complete there and the compiler cannot
// move them past it (a store to shared memory no thread ever makes, guarded
// by a runtime test on their xor). Otherwise nothing.
template <typename... V>
__device__ __forceinline__ void qab_pin_loads(const V&... vs) {
#ifdef QAB_PIN_LOADS
  __shared__ uint32_t qab_pin_sink;
  uint32_t x = 0u;
  (qab_pin_xor(x, vs), ...);
  if (x == 0x9e3779b9u && threadIdx.x == 0xffffu) {  // never: BLOCK < 65,535
    qab_pin_sink = x;
  }
#endif
}

// Waits until the counter *p reaches at least target: an acquire load at GPU
// scope, polled with a short sleep. One thread of a block calls it, then the
// block's barrier; data the counted blocks wrote is then read through L2
// (qab_ld<true>). Only for counts that blocks already running will reach (a
// launch's ticketed phases, moe_decode_block.cu): a wait on a block that has
// not started could wait forever.
// A profiling build may define QAB_WAIT_RELAXED: relaxed polls, then one
// acquire fence (the PTX model's fence-based acquire pattern).
__device__ __forceinline__ void qab_wait_count(const uint32_t* p, uint32_t target) {
  uint32_t v;
  while (true) {
#ifdef QAB_WAIT_RELAXED
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
#else
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
#endif
    if (v >= target) {
      break;
    }
    __nanosleep(QAB_WAIT_SLEEP_NS);
  }
#ifdef QAB_WAIT_RELAXED
  asm volatile("fence.acq_rel.gpu;" ::: "memory");
#endif
}

// y * sigmoid(x) rounded as mlx-lm's `out * mx.sigmoid(gate)` in T (Qwen3-Next's
// attention output gate): each step of MLX's sigmoid (e = exp(|x|), r = 1 / (1 + e),
// x < 0 ? r : 1 - r) and the product rounded to T.
template <typename T>
__device__ __forceinline__ T qab_sigmoid_gate(const T y, const float x) {
  const T ex = static_cast<T>(expf(fabsf(x)));
  const T one_e = static_cast<T>(1.f + static_cast<float>(ex));
  const T r = static_cast<T>(1.f / static_cast<float>(one_e));
  const T sg = x < 0.f ? r : static_cast<T>(1.f - static_cast<float>(r));
  return static_cast<T>(static_cast<float>(y) * static_cast<float>(sg));
}
